"""Every compiled jax_tma kernel configuration once, on small products with ragged edges, for
scripts/sanitize.sh (compute-sanitizer runs this process).

Dense GEMM: every tile of jax_tma.COMPILED_CONFIGS in the four operand layouts (NN, NT, TN,
TT), split-K and stream-K, and the direct-store epilogue (output rows that are not 16-byte
multiples). Fused epilogues: every compiled (tile, fusion) of jax_tma.DENSE_CONFIGS (bias,
activation, residual and pre-activation output; activation gradients; gated pairs; gated
gradients). Ragged: every tile of jax_tma.RAGGED_CONFIGS in the rows mode (weights N- and
K-major) and the contraction mode, every gated tile (GATED_RAGGED_CONFIGS, with the
pre-activations) and every gated gradient tile (GATED_RAGGED_GRAD_CONFIGS, silu and the tanh
GELU: both cotangents), with an empty group and rows past the last group. FP8: every compiled tile
and type with block scales and a bias, and every fast-accumulation tile; FP8 ragged
(fp8_ragged_dot): every tile of jax_tma.FP8_RAGGED_CONFIGS and output type, with block scales,
groups starting at every row offset mod 4, an empty group and rows past the last. All cases
run in one jitted function (one XLA compile), on operands made by numpy and copied to the device
(no jax.random kernels: initcheck reports uninitialised reads there that are not jax_tma's), over
NaN-poisoned outputs, and each result is checked against a float64 reference. Prints one line
per case and a summary; exit status 1 when any case is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_tma
from jax_tma import _testing
from jax_tma._core.config import stream_k_variants
from jax_tma.ops.fp8 import config as fp8_config
from jax_tma.ops.fp8 import primitive as fp8
from jax_tma.ops.fp8 import quantize as fp8_quantize
from jax_tma.ops.fp8 import ragged_primitive as fp8_ragged
from jax_tma.ops.gemm import config as gemm_config
from jax_tma.ops.dense import config as ep_config
from jax_tma.ops.dense import primitive as ep
from jax_tma.ops.ragged import config as rd_config
from jax_tma.ops.ragged import gated_grad_primitive as ggp
from jax_tma.ops.ragged import gated_primitive as gp
from jax_tma.ops.ragged import primitive as rd

BF16 = np.dtype(ml_dtypes.bfloat16)
LAYOUTS = {  # lhs shape, rhs shape, dimension numbers of A @ B for M, N, K
    "NN": (lambda m, k: (m, k), lambda k, n: (k, n), (((1,), (0,)), ((), ()))),
    "NT": (lambda m, k: (m, k), lambda k, n: (n, k), (((1,), (1,)), ((), ()))),
    "TN": (lambda m, k: (k, m), lambda k, n: (k, n), (((0,), (0,)), ((), ()))),
    "TT": (lambda m, k: (k, m), lambda k, n: (n, k), (((0,), (1,)), ((), ()))),
}


@dataclasses.dataclass
class Case:
    name: str
    run: object  # () -> jax.Array (traced inside the one jit)
    reference: np.ndarray
    tolerance: float


def _f64(x):
    return np.asarray(x, np.float64)


def _dense_cases(rng, m, n, k) -> list[Case]:
    cases = []
    configs = [*gemm_config.COMPILED_CONFIGS, jax_tma.GemmConfig(128, 128, 6, 1, split_k=3),
               *stream_k_variants(gemm_config.COMPILED_CONFIGS)]
    for layout, (lhs_of, rhs_of, dims) in LAYOUTS.items():
        lhs = rng.standard_normal(lhs_of(m, k)).astype(BF16)
        rhs = rng.standard_normal(rhs_of(k, n)).astype(BF16)
        ref = np.asarray(jax.lax.dot_general(_f64(lhs), _f64(rhs), dims))
        for cfg in configs:
            out_dtype = jnp.float32 if cfg.split_k > 1 else BF16
            run = (lambda lhs=lhs, rhs=rhs, cfg=cfg, dims=dims, out_dtype=out_dtype:
                   _testing.gemm_poisoned(lhs, rhs, out_dtype, config=cfg,
                                          dimension_numbers=dims))
            cases.append(Case(f"gemm {layout} {cfg.describe()}", run, ref, 1e-2))
    # Direct-store epilogue: 100 bf16 columns are 200-byte rows.
    lhs = rng.standard_normal((m, k)).astype(BF16)
    rhs = rng.standard_normal((k, 100)).astype(BF16)
    for cfg in gemm_config.COMPILED_CONFIGS:
        if cfg.has_direct_store:
            run = (lambda cfg=cfg, lhs=lhs, rhs=rhs:
                   _testing.gemm_poisoned(lhs, rhs, BF16, config=cfg))
            cases.append(Case(f"gemm direct-store {cfg.describe()}", run,
                              _f64(lhs) @ _f64(rhs), 1e-2))
    return cases


def _fused_cases(rng, m, n, k) -> list[Case]:
    x = rng.standard_normal((m, k)).astype(BF16)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(BF16)
    w2 = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(BF16)
    bias = rng.standard_normal(n).astype(np.float32)
    aux = rng.standard_normal((m, n)).astype(BF16)
    wt = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(BF16)  # gradient: [n, k] read K-major
    z = rng.standard_normal((m, n)).astype(BF16)
    x64 = _f64(x)
    # The float64 products every tile's references share.
    xw, xw2, xwt = x64 @ _f64(w), x64 @ _f64(w2), x64 @ _f64(wt).T
    cases = []
    for cfg in ep_config.DENSE_CONFIGS:
        for act in ("none", "relu", "gelu_tanh", "gelu_erf", "silu"):
            activation = None if act == "none" else act
            if act == "gelu_erf" and cfg.tile not in ep_config._NARROW_TILES:
                continue
            ref = _f64(ep.activate(activation, jnp.asarray(xw + bias, jnp.float32)))
            ref = ref + _f64(aux)
            run = (lambda cfg=cfg, activation=activation: ep._kernel_call(
                jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), jnp.asarray(aux),
                kind=ep_config.FORWARD, activation=activation, has_bias=True, has_aux=True,
                save_pre=True, b_k_major=False, out_dtype=BF16, config=cfg, poison=True)[0])
            cases.append(Case(f"dense forward {act} {cfg.describe()}", run, ref, 1e-2))
        # On 128-row tiles the epilogue warps finish these: bias + gelu alone, and the residual
        # through their ring without a saved pre-activation.
        for has_aux in (False, True):
            ref = _f64(ep.activate("gelu_tanh", jnp.asarray(xw + bias, jnp.float32)))
            ref = ref + _f64(aux) if has_aux else ref
            operands = (x, w, bias, aux) if has_aux else (x, w, bias)
            run = (lambda cfg=cfg, has_aux=has_aux, operands=operands: ep._kernel_call(
                *map(jnp.asarray, operands), kind=ep_config.FORWARD, activation="gelu_tanh",
                has_bias=True, has_aux=has_aux, save_pre=False, b_k_major=False, out_dtype=BF16,
                config=cfg, poison=True)[0])
            name = "bias + gelu" + (" + residual" if has_aux else "")
            cases.append(Case(f"dense forward {name} {cfg.describe()}", run, ref, 1e-2))
        for act in ("relu", "gelu_tanh", "gelu_erf", "silu"):
            slope = _f64(ep.activation_grad(act, jnp.asarray(z, jnp.float32)))
            ref = xwt * slope
            run = (lambda cfg=cfg, act=act: ep._kernel_call(
                jnp.asarray(x), jnp.asarray(wt), jnp.asarray(z), kind=ep_config.GRADIENT,
                activation=act, has_bias=False, has_aux=True, save_pre=False, b_k_major=True,
                out_dtype=BF16, config=cfg, poison=True)[0])
            cases.append(Case(f"dense gradient {act} {cfg.describe()}", run, ref, 1e-2))
        for act in ("silu", "gelu_tanh", "gelu_erf"):
            ref = _f64(ep.activate(act, jnp.asarray(xw, jnp.float32))) * xw2
            run = (lambda cfg=cfg, act=act: ep._kernel_call(
                jnp.asarray(x), jnp.asarray(w), jnp.asarray(w2), kind=ep_config.GATED,
                activation=act, has_bias=False, has_aux=False, save_pre=True, b_k_major=False,
                out_dtype=BF16, config=cfg, poison=True)[0])
            cases.append(Case(f"dense gated {act} {cfg.describe()}", run, ref, 1e-2))
    # The gated gradient (epilogue warps only, on the ring tiles): both cotangents, from the
    # gate and up pre-activations [2, m, n]; m = 300 leaves a CTA's last tile a warpgroup
    # without rows.
    pre = rng.standard_normal((2, m, n)).astype(BF16)
    for cfg in ep_config.configs_for(ep_config.GATED_GRADIENT, "silu"):
        for act in ("silu", "gelu_tanh"):
            slope = _f64(ep.activation_grad(act, jnp.asarray(pre[0], jnp.float32)))
            up_ct = xwt * _f64(ep.activate(act, jnp.asarray(pre[0], jnp.float32)))
            ref = np.concatenate([(xwt * _f64(pre[1]) * slope).ravel(), up_ct.ravel()])
            run = (lambda cfg=cfg, act=act: jnp.concatenate([o.ravel() for o in ep._kernel_call(
                jnp.asarray(x), jnp.asarray(wt), jnp.asarray(pre), kind=ep_config.GATED_GRADIENT,
                activation=act, has_bias=False, has_aux=True, save_pre=False, b_k_major=True,
                out_dtype=BF16, config=cfg, poison=True)]))
            cases.append(Case(f"dense gated gradient {act} {cfg.describe()}", run, ref, 1e-2))
    return cases


def _ragged_cases(rng, m, n, k, g) -> list[Case]:
    sizes = rng.multinomial(m - m // 5, np.ones(g) / g).astype(np.int32)
    sizes[1] = 0  # an empty group; rows past the last group stay zero
    x = rng.standard_normal((m, k)).astype(BF16)
    w = rng.standard_normal((g, k, n)).astype(BF16)
    dy = rng.standard_normal((m, n)).astype(BF16)
    w_up = rng.standard_normal((g, k, n)).astype(BF16)  # the gated mode's second weights
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rows_ref = np.zeros((m, n))
    up_ref = np.zeros((m, n))
    grad_ref = np.zeros((g, k, n))
    for i in range(g):
        rows = slice(starts[i], starts[i + 1])
        rows_ref[rows] = _f64(x[rows]) @ _f64(w[i])
        up_ref[rows] = _f64(x[rows]) @ _f64(w_up[i])
        grad_ref[i] = _f64(x[rows]).T @ _f64(dy[rows])
    cases = []
    for cfg in rd_config.RAGGED_CONFIGS:
        for mode, w_k_major, second, ref in (
                (rd_config.ROWS, False, w, rows_ref),
                (rd_config.ROWS, True, np.ascontiguousarray(np.swapaxes(w, 1, 2)), rows_ref),
                (rd_config.CONTRACTION, False, dy, grad_ref)):
            def run(cfg=cfg, mode=mode, w_k_major=w_k_major, second=second):
                args = (jnp.asarray(x)[None], jnp.asarray(second)[None],
                        jnp.asarray(sizes)[None])
                plan = rd.kernel_plan(*args, mode, w_k_major, jnp.float32)
                return rd._kernel_call(*args, plan=plan, w_k_major=w_k_major,
                                       out_dtype=jnp.float32, config=cfg, poison=True)[0]
            name = f"ragged {mode}{' k-major' if w_k_major else ''} {cfg.describe()}"
            cases.append(Case(name, run, ref, 1e-4))
    # The gated rows mode (gated_ragged_dot): silu(x @ w_gate) * (x @ w_up), its result and
    # the saved pre-activations through their per-segment maps.
    gated_ref = rows_ref / (1 + np.exp(-rows_ref)) * up_ref
    for cfg in rd_config.GATED_RAGGED_CONFIGS:
        def run(cfg=cfg):
            args = (jnp.asarray(x)[None], jnp.asarray(w)[None], jnp.asarray(w_up)[None],
                    jnp.asarray(sizes)[None])
            plan = gp.gated_kernel_plan(*args, BF16)
            out, pre = gp._kernel_call(*args, activation="silu", save_pre=True, out_dtype=BF16,
                                       config=cfg, plan=plan, poison=True)
            return jnp.concatenate([out[0], pre[0, 0], pre[1, 0]], axis=1)
        ref = np.concatenate([gated_ref, rows_ref, up_ref], axis=1)
        cases.append(Case(f"ragged gated silu {cfg.describe()}", run, ref, 1e-2))
    # The gated gradient rows mode (gated_ragged_mlp's backward): dh = dy @ w_down[g]^T with dy
    # = x and w_down = w stored [G, n, k] (so dh = rows_ref), both cotangents from the saved
    # pre-activations through their per-segment maps; zero past the last group.
    pre = rng.standard_normal((2, m, n)).astype(BF16)
    w_down = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    for cfg in rd_config.GATED_RAGGED_GRAD_CONFIGS:
        for act in ggp.KERNEL_ACTIVATIONS:
            gate = jnp.asarray(pre[0], jnp.float32)
            slope = _f64(ep.activation_grad(act, gate))
            ref = np.concatenate([rows_ref * _f64(pre[1]) * slope,
                                  rows_ref * _f64(ep.activate(act, gate))], axis=1)

            def run(cfg=cfg, act=act):
                args = (jnp.asarray(x)[None], jnp.asarray(w_down)[None],
                        jnp.asarray(sizes)[None], jnp.asarray(pre)[:, None])
                plan = ggp.gated_grad_kernel_plan(*args, act, BF16)
                d_gate, d_up = ggp._kernel_call(*args, activation=act, out_dtype=BF16,
                                                config=cfg, plan=plan, poison=True)
                return jnp.concatenate([d_gate[0], d_up[0]], axis=1)
            cases.append(Case(f"ragged gated gradient {act} {cfg.describe()}", run, ref, 1e-2))
    return cases


def _fp8_cases(rng, m, n, k) -> list[Case]:
    """Every compiled FP8 tile, both FP8 types, bf16 and fp32 out, with block scales (1x128 on
    A, 128x128 on B: every scale load; N = 776 puts tiles at each offset in B's scale box) and a
    bias; and every fast tile (per-tensor scales, the tensor core's accumulation); each on
    stream-K too where the tile takes it (its workspace, flags and partial tiles)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    cases = []
    for dtype in fp8_config.FP8_DTYPES:
        a, sa = (np.asarray(v) for v in jax_tma.quantize_fp8(x, (1, 128), dtype))
        b, sb = (np.asarray(v) for v in jax_tma.quantize_fp8(w, (128, 128), dtype))
        ref = (_f64(fp8_quantize.dequantize_fp8(a, sa, (1, 128)))
               @ _f64(fp8_quantize.dequantize_fp8(b, sb, (128, 128))).T + bias)
        for cfg in (*fp8_config.FP8_CONFIGS, *stream_k_variants(fp8_config.FP8_CONFIGS)):
            for out_dtype in fp8_config.OUT_DTYPES:
                run = (lambda a=a, b=b, sa=sa, sb=sb, cfg=cfg, out_dtype=out_dtype:
                       fp8._kernel_call(jnp.asarray(a), jnp.asarray(b), jnp.asarray(sa),
                                        jnp.asarray(sb), jnp.asarray(bias), has_sa=True,
                                        has_sb=True, row_scale=fp8.NONE, col_scale=fp8.NONE,
                                        has_bias=True, out_dtype=out_dtype, config=cfg,
                                        poison=True))
                name = f"fp8 {dtype.name}->{out_dtype.name} {cfg.describe()}"
                cases.append(Case(name, run, ref, 1e-2))
        a, sa = (np.asarray(v) for v in jax_tma.quantize_fp8(x, None, dtype))
        b, sb = (np.asarray(v) for v in jax_tma.quantize_fp8(w, None, dtype))
        ref = (_f64(fp8_quantize.dequantize_fp8(a, sa))
               @ _f64(fp8_quantize.dequantize_fp8(b, sb)).T)
        for cfg in (*fp8_config.FP8_FAST_CONFIGS,
                    *stream_k_variants(fp8_config.FP8_FAST_CONFIGS)):
            for out_dtype in fp8_config.OUT_DTYPES:
                run = (lambda a=a, b=b, sa=sa, sb=sb, cfg=cfg, out_dtype=out_dtype:
                       fp8._kernel_call(jnp.asarray(a), jnp.asarray(b), jnp.asarray(sa),
                                        jnp.asarray(sb), has_sa=False, has_sb=False,
                                        row_scale=fp8.SCALAR, col_scale=fp8.SCALAR,
                                        has_bias=False, out_dtype=out_dtype, config=cfg,
                                        promote=False, poison=True))
                name = f"fp8 fast {dtype.name}->{out_dtype.name} {cfg.describe()}"
                cases.append(Case(name, run, ref, 1e-2))
    return cases


def _fp8_ragged_cases(rng, m, n, k) -> list[Case]:
    """Every compiled FP8 ragged tile and output type, e4m3 with block scales; groups of 1, 2, 3,
    ... rows first (their first rows at every offset mod 4: A's scale boxes start at the
    4-aligned row before), an empty group, rows past the last group."""
    sizes = np.array([1, 2, 3, 0, 70, m // 2], np.int32)
    g = len(sizes)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, n, k)) / np.sqrt(k)).astype(np.float32)
    dtype = jnp.float8_e4m3fn
    a, sa = (np.asarray(v) for v in jax_tma.quantize_fp8(x, (1, 128), dtype))
    b, sb = (np.asarray(v) for v in jax_tma.quantize_fp8(w, (128, 128), dtype))
    xd = _f64(fp8_quantize.dequantize_fp8(a, sa, (1, 128)))
    wd = _f64(fp8_quantize.dequantize_fp8(b, sb, (128, 128)))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ref = np.zeros((m, n))
    for i in range(g):
        rows = slice(starts[i], starts[i + 1])
        ref[rows] = xd[rows] @ wd[i].T
    cases = []
    for cfg in fp8_config.FP8_RAGGED_CONFIGS:
        for out_dtype in fp8_config.OUT_DTYPES:
            def run(cfg=cfg, out_dtype=out_dtype):
                args = (jnp.asarray(a)[None], jnp.asarray(b)[None], jnp.asarray(sizes)[None])
                plan = fp8_ragged.kernel_plan(*args, out_dtype)
                return fp8_ragged._kernel_call(*args, jnp.asarray(sa)[None], jnp.asarray(sb)[None],
                                               plan=plan, sa_block=True, sb_block=True,
                                               out_dtype=out_dtype, config=cfg, poison=True)[0]
            cases.append(Case(f"fp8 ragged ->{out_dtype.name} {cfg.describe()}", run, ref, 1e-2))
    return cases


FAMILIES = ("gemm", "dense", "ragged", "fp8")  # the first word of every case's name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="",
                   help=f"comma-separated case families to run: {', '.join(FAMILIES)} "
                        "(default: all)")
    p.add_argument("--families", action="store_true",
                   help="print the case families, comma-separated, and exit (scripts/sanitize.sh "
                        "runs each in a process of its own)")
    args = p.parse_args(argv)
    if args.families:
        print(",".join(FAMILIES))
        return 0
    families = set(FAMILIES)
    only = {f for f in args.only.split(",") if f} or families
    if only - families:
        p.error(f"--only: unknown families {sorted(only - families)}; known: {sorted(families)}")
    status = jax_tma.kernel_status()
    if not status.available:
        print(f"jax_tma kernels unavailable here: {status.reason}")
        return 1
    rng = np.random.default_rng(args.seed)
    cases = (_dense_cases(rng, 200, 320, 264) + _fused_cases(rng, 300, 328, 200)
             + _ragged_cases(rng, 500, 192, 136, 6) + _fp8_cases(rng, 260, 776, 520)
             + _fp8_ragged_cases(rng, 260, 776, 520))
    cases = [c for c in cases if c.name.split()[0] in only]
    outputs = jax.jit(lambda: [c.run() for c in cases])()
    failed = 0
    for case, out in zip(cases, outputs):
        out = np.asarray(out, np.float64)
        ref = case.reference
        err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))
        ok = not np.isnan(out).any() and err <= case.tolerance
        failed += not ok
        print(f"case {case.name}: rel. error {err:.2e} {'ok' if ok else 'WRONG'}")
    print(f"{len(cases)} cases, {failed} wrong")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
