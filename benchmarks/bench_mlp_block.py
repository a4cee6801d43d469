"""One training step of a transformer MLP block in Flax, with every Dense on
``jax_tma.dot_general``, and the same block on jax_tma's fused layers (``jax_tma.mlp``,
``gated_mlp``: FusedMLPBlock), against the block on the default ``lax.dot_general``.

The block: LayerNorm -> Dense d->f -> gelu -> Dense f->d, plus the residual (``gelu``); or
LayerNorm -> silu(Dense d->f) * Dense d->f -> Dense f->d, plus the residual (``swiglu``). Dense
layers have no bias; parameters and adamw state are float32, the block computes in bf16 (or
fp16), inputs are [tokens / seq, seq, d]. A step is forward, backward and the optax adamw
update; every Dense contributes three products (forward, input gradient, weight gradient).

Both steps run through jax_tma._timing.compare, as bench_gemm does: each timed call evaluates
``--sets`` steps inside one jit, each on its own batch and target (nothing donated, so every
step starts from the same parameters and optimizer state and returns whole new ones); rounds
alternate between the two; on a GPU the time is the sum of the kernel durations (CUPTI).
Before timing, the losses and gradients of the two are compared.

    python benchmarks/bench_mlp_block.py             # gelu d=4096 f=16384, swiglu f=14336
    python benchmarks/bench_mlp_block.py --quick     # the gelu block only, fewer rounds
    python benchmarks/bench_mlp_block.py --block swiglu --tokens 16384 --d-model 4096 --d-ff 14336
    python benchmarks/bench_mlp_block.py --dry-run   # tiny sizes; runs without a GPU (CI)
    python benchmarks/bench_mlp_block.py --breakdown # also each step's kernels (CUPTI)

Reports ms/step, TFLOP/s of the matmuls (6 * tokens * Dense parameters per step) and the ratio
of the two times; writes bench_mlp_block[_fp16] .json, .md and .png under
benchmarks/results/<device>/ (a dry run only with --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_tma
from jax_tma import _timing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _lib.report import banner, environment, pyplot, save_figure, write_report  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
CHECK_TOLERANCE = 2e-2  # relative loss and gradient difference between the two steps
_CALL_TARGET = re.compile(r'custom_call_target="(jax_tma_[^"]*)"')
# Kernel names of the products (cuBLAS's and jax_tma's) in a CUPTI breakdown.
_PRODUCT_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    block: str  # "gelu" or "swiglu"
    tokens: int
    seq: int
    d_model: int
    d_ff: int

    @property
    def projections(self) -> int:
        return 3 if self.block == "swiglu" else 2

    @property
    def dense_params(self) -> int:
        return self.projections * self.d_model * self.d_ff

    @property
    def matmul_flops(self) -> float:
        """Forward (2) and backward (4) flops of every Dense, per step."""
        return 6.0 * self.tokens * self.dense_params

    def describe(self) -> str:
        return (f"{self.block} tokens={self.tokens} (seq {self.seq}) d={self.d_model} "
                f"f={self.d_ff}")


SUITE = [BlockConfig("gelu", 8192, 2048, 4096, 16384),
         BlockConfig("swiglu", 8192, 2048, 4096, 14336)]
QUICK = SUITE[:1]
DRY_RUN = [BlockConfig("gelu", 64, 16, 64, 256), BlockConfig("swiglu", 64, 16, 64, 192)]


class MLPBlock(nn.Module):
    """Pre-LayerNorm transformer MLP block with a residual connection."""

    d_model: int
    d_ff: int
    swiglu: bool
    dtype: Any
    dot_general: Callable

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype,
                                  dot_general=self.dot_general)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        if self.swiglu:
            h = nn.silu(dense(self.d_ff, name="gate")(h)) * dense(self.d_ff, name="up")(h)
        else:
            h = nn.gelu(dense(self.d_ff, name="up")(h))
        return x + dense(self.d_model, name="down")(h)


class _Kernel(nn.Module):
    """An nn.Dense's kernel parameter alone (same name, shape and initialiser)."""

    shape: tuple[int, int]

    @nn.compact
    def __call__(self):
        return self.param("kernel", nn.initializers.lecun_normal(), self.shape, jnp.float32)


class FusedMLPBlock(nn.Module):
    """MLPBlock's parameters and math on jax_tma's fused layers: gelu through jax_tma.mlp (bias-
    free; the backward product applies gelu' in its epilogue), SwiGLU through gated_mlp (gate,
    up and their combination in one kernel, the down projection plus the residual in another;
    the backward product writes the gate's and up's cotangents from its epilogue)."""

    d_model: int
    d_ff: int
    swiglu: bool
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm(dtype=self.dtype)(x)
        d, f = self.d_model, self.d_ff
        lead = x.shape[:-1]
        h2, x2 = h.reshape(-1, d).astype(self.dtype), x.reshape(-1, d).astype(self.dtype)
        down = _Kernel((f, d), name="down")().astype(self.dtype)
        if self.swiglu:
            gate = _Kernel((d, f), name="gate")().astype(self.dtype)
            up = _Kernel((d, f), name="up")().astype(self.dtype)
            y = jax_tma.gated_mlp(h2, gate, up, down, "silu", residual=x2)
        else:
            up = _Kernel((d, f), name="up")().astype(self.dtype)
            y = jax_tma.mlp(h2, up, None, down, None, "gelu", residual=x2)
        return y.reshape(*lead, d)


def make_step(cfg: BlockConfig, dtype, dot_general, optimizer, fused: bool = False):
    """(params, opt_state, x, target) -> (params, opt_state, loss): one adamw step."""
    model = (FusedMLPBlock(cfg.d_model, cfg.d_ff, cfg.block == "swiglu", dtype) if fused
             else MLPBlock(cfg.d_model, cfg.d_ff, cfg.block == "swiglu", dtype, dot_general))

    def loss_fn(params, x, target):
        out = model.apply(params, x).astype(jnp.float32)
        return jnp.mean((out - target.astype(jnp.float32)) ** 2)

    def step(params, opt_state, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, loss_fn, step


def kernel_calls(fn: Callable, *args) -> int:
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return len(_CALL_TARGET.findall(hlo))


def breakdown(step: Callable, operands) -> dict | None:
    """One step's kernels (CUPTI medians, launch order), its products' total and the rest's;
    None where CUPTI timing is unavailable."""
    kernels = _timing.kernel_breakdown(step, operands)
    if kernels is None:
        return None
    products = sum(s for name, s in kernels if _PRODUCT_KERNEL.search(name))
    total = sum(s for _, s in kernels)
    return {"total_ms": total * 1e3, "products_ms": products * 1e3,
            "rest_ms": (total - products) * 1e3,
            "kernels": [[name, s * 1e6] for name, s in kernels]}


def _print_breakdown(cfg: BlockConfig, name: str, found: dict | None) -> None:
    if found is None:
        print(f"{cfg.block} {name}: no kernel breakdown (CUPTI unavailable)")
        return
    print(f"{cfg.block} {name}: {found['total_ms']:.3f} ms, products {found['products_ms']:.3f}, "
          f"the rest {found['rest_ms']:.3f} ({len(found['kernels'])} kernels)")
    for kernel, us in found["kernels"]:
        mark = "P" if _PRODUCT_KERNEL.search(kernel) else " "
        print(f"  {us:9.1f} us {mark} {kernel}")


def bench_block(cfg: BlockConfig, dtype, args) -> dict:
    """Times one training step of both contenders on ``cfg``; returns a JSON-ready row."""
    optimizer = optax.adamw(1e-4, weight_decay=0.1)
    model, loss_tma, step_tma = make_step(cfg, dtype, jax_tma.dot_general, optimizer)
    _, loss_fused, step_fused = make_step(cfg, dtype, None, optimizer, fused=True)
    _, loss_xla, step_xla = make_step(cfg, dtype, jax.lax.dot_general, optimizer)
    shape = (cfg.tokens // cfg.seq, cfg.seq, cfg.d_model)
    batches = _timing.random_operands(jax.random.key(cfg.tokens + cfg.d_ff), [shape, shape],
                                      dtype, args.sets)
    params = jax.jit(model.init)(jax.random.key(0), batches[0][0])
    opt_state = jax.jit(optimizer.init)(params)

    # The two steps must agree before their times mean anything.
    x, target = batches[0]
    loss_a, grads_a = jax.jit(jax.value_and_grad(loss_tma))(params, x, target)
    loss_b, grads_b = jax.jit(jax.value_and_grad(loss_xla))(params, x, target)
    loss_c, grads_c = jax.jit(jax.value_and_grad(loss_fused))(params, x, target)
    loss_diff = max(abs(float(v) - float(loss_b)) / abs(float(loss_b)) for v in (loss_a, loss_c))
    grad_err = max(_timing.tree_relative_error(g, grads_b) for g in (grads_a, grads_c))
    calls = {name: kernel_calls(fn, params, opt_state, x, target)
             for name, fn in (("jax_tma", step_tma), ("jax_tma_fused", step_fused),
                              ("xla", step_xla))}

    sets = [(params, opt_state, x, t) for x, t in batches]
    timings = _timing.compare({"jax_tma": step_tma, "jax_tma_fused": step_fused,
                               "xla": step_xla}, sets,
                              rounds=args.rounds, iterations=args.iterations)
    row = dict(dataclasses.asdict(cfg), dense_params=cfg.dense_params,
               matmul_tflop_per_step=cfg.matmul_flops / 1e12,
               loss_rel_diff=loss_diff, grad_rel_error=grad_err,
               check_ok=loss_diff <= CHECK_TOLERANCE and grad_err <= CHECK_TOLERANCE,
               kernel_calls=calls,
               expected_kernel_calls=3 * cfg.projections if jax_tma.kernel_status().available
               else 0)
    for name, t in timings.items():
        row[name] = {"ms_per_step": t.median_s * 1e3, "spread_ms": t.spread_s * 1e3,
                     "samples": t.samples, "matmul_tflops": cfg.matmul_flops / t.median_s / 1e12}
    row["ratio"] = timings["xla"].median_s / timings["jax_tma"].median_s
    row["ratio_fused"] = timings["xla"].median_s / timings["jax_tma_fused"].median_s
    if args.breakdown:
        row["breakdown"] = {}
        for name, step in (("xla", step_xla), ("jax_tma_fused", step_fused)):
            row["breakdown"][name] = breakdown(step, sets[0])
            _print_breakdown(cfg, name, row["breakdown"][name])
    return row


def _table(rows: list[dict], env: dict, dtype: str) -> str:
    lines = [
        f"{env['device']}, driver {env['driver']}, CUDA {env.get('cuda_runtime')}, "
        f"jax {env['jax']}, {env['date']}, {dtype} compute, float32 params + adamw, timing: "
        f"{env['timing']}; TFLOP/s counts the matmuls only (6 · tokens · Dense params)",
        "",
        "| block | tokens | d | f | jax_tma ms/step | jax_tma TFLOP/s | fused ms/step "
        "| fused TFLOP/s | XLA ms/step | XLA TFLOP/s | ratio (XLA / jax_tma) "
        "| ratio (XLA / fused) | jax_tma calls / step | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, xla, fused = r["jax_tma"], r["xla"], r["jax_tma_fused"]
        check = "ok" if r["check_ok"] else (
            f"MISMATCH (loss {r['loss_rel_diff']:.1e}, grads {r['grad_rel_error']:.1e})")
        lines.append(
            f"| {r['block']} | {r['tokens']} | {r['d_model']} | {r['d_ff']} "
            f"| {ours['ms_per_step']:.3f} ± {ours['spread_ms']:.3f} | {ours['matmul_tflops']:.1f} "
            f"| {fused['ms_per_step']:.3f} ± {fused['spread_ms']:.3f} "
            f"| {fused['matmul_tflops']:.1f} "
            f"| {xla['ms_per_step']:.3f} ± {xla['spread_ms']:.3f} | {xla['matmul_tflops']:.1f} "
            f"| {r['ratio']:.3f} | {r['ratio_fused']:.3f} | {r['kernel_calls']['jax_tma']} of "
            f"{r['expected_kernel_calls']} | {check} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    labels = [f"{r['block']}\nd={r['d_model']} f={r['d_ff']}\n{r['tokens']} tokens" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 2.5 * len(rows)), 4))
    for i, name in enumerate(("jax_tma", "jax_tma_fused", "xla")):
        ax.bar(x + (i - 1) * 0.27, [r[name]["ms_per_step"] for r in rows], 0.27, label=name)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("ms per training step")
    ax.set_title(title)
    ax.legend()
    return save_figure(plt, fig, path)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the gelu block only, 3 rounds")
    p.add_argument("--block", choices=("gelu", "swiglu"),
                   help="one block at the sizes given (default: the suite)")
    p.add_argument("--tokens", type=int, default=8192, help="batch x seq")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-ff", type=int, default=None, help="default 4 d (gelu), 3.5 d (swiglu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--sets", type=int, default=2,
                   help="steps per timed call, each on its own batch")
    # NOTE: a step is 10-14 ms and its rounds spread 3-7 % (clock at the power cap): at 5 rounds
    # the medians' ratio moved 1.03-1.08x between runs of the same code; rounds cost little
    # beside the compiles.
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iterations", type=int, default=3, help="timed calls per round")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="results directory (default benchmarks/results; files go to "
                        "<out>/<device>/)")
    p.add_argument("--commit", help="commit to record instead of `git rev-parse HEAD`")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes, 1 round; files only with --out; runs without a GPU")
    p.add_argument("--breakdown", action="store_true",
                   help="also list the kernels of XLA's and the fused step (CUPTI), their "
                        "products' time and the rest's")
    args = p.parse_args(argv)
    if args.block:
        d_ff = args.d_ff or (4 * args.d_model if args.block == "gelu"
                             else 7 * args.d_model // 2)
        if min(args.tokens, args.seq, args.d_model, d_ff, args.sets) < 1 or args.tokens % args.seq:
            p.error(f"--tokens ({args.tokens}) must be a positive multiple of --seq ({args.seq});"
                    " sizes and --sets positive")
        args.configs = [BlockConfig(args.block, args.tokens, args.seq, args.d_model, d_ff)]
    else:
        args.configs = DRY_RUN if args.dry_run else QUICK if args.quick else SUITE
    if args.quick:
        args.rounds = min(args.rounds, 3)
    if args.dry_run:
        args.rounds, args.iterations = 1, 1
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    dtype = DTYPES[args.dtype]
    env = environment(args.commit)
    print(banner(env, args.dtype), flush=True)
    rows = []
    for i, cfg in enumerate(args.configs):
        print(f"[{i + 1}/{len(args.configs)}] {cfg.describe()} ...", end="", file=sys.stderr,
              flush=True)
        row = bench_block(cfg, dtype, args)
        rows.append(row)
        print(f" jax_tma {row['jax_tma']['ms_per_step']:.3f}, fused "
              f"{row['jax_tma_fused']['ms_per_step']:.3f} vs XLA "
              f"{row['xla']['ms_per_step']:.3f} ms/step", file=sys.stderr, flush=True)
    table = _table(rows, env, args.dtype)
    print(table)
    if args.dry_run and args.out is None:
        return 0
    write_report(
        args.out, env, "bench_mlp_block" + ("" if args.dtype == "bf16" else f"_{args.dtype}"),
        {"environment": env, "dtype": args.dtype, "dry_run": args.dry_run, "sets": args.sets,
         "rows": rows},
        table, lambda path: _plot(rows, path, f"{env['device']}, {args.dtype}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
