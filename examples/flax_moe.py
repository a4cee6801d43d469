"""Train a small model built on ``jax_tma.flax.MoE`` twice, with the experts' products on
jax_tma's grouped kernel and on ``jax.lax.ragged_dot`` (the layer's ``implementation="xla"``),
from the same initial parameters on the same data, and compare the loss curves.

    python examples/flax_moe.py                    # 8 experts, top-2, bf16, 300 adam steps
    python examples/flax_moe.py --experts 64 --top-k 8 --tokens 8192 --d-model 1024 --d-ff 768
    python examples/flax_moe.py --fp8              # FP8 experts against the bf16 kernels

The model is ``x + MoE(x)``: a SwiGLU expert layer (router, top-k, tokens sorted by expert, the
experts' gate-and-up and down products as grouped GEMMs, weighted combine) and its residual.
The loss is the mean squared error against a fixed random teacher of the same shape plus 1e-2
times the layer's load-balancing loss (sown in "intermediates"). Parameters and adam state are
float32; the experts compute in ``--dtype``.

On an H100/H200 the experts' gated first half is one ``jax_tma_gated_ragged_dot_sm90`` call
(act(gate) * up stored once), the down projection's input gradient one
``jax_tma_gated_ragged_grad_sm90`` call (which writes the gate's and the up's cotangents from its
epilogue) and every other grouped product one ``jax_tma_ragged_dot_sm90`` call: 6 per training
step (forward: the gated call and the down projection; backward: the gated gradient call and the
weight gradients of w_gate, w_up and w_down; the rows are gathered from the data, which is not
trained, so no gradient reaches them). The script
prints both curves, their largest relative difference and the kernel calls per compiled step;
exit status 1 when the curves differ by more than the dtype's tolerance or the call count is
not the expected one.

``--fp8`` trains the layer with ``implementation="jax_tma_fp8"`` (every expert product in FP8,
DeepSeek-V3's recipe: e4m3 rows per 1 x 128 and weights per 128 x 128 block) against the same
layer on the bf16 kernels. Per step: the gate-and-up and the down products and the down
product's input gradient on ``jax_tma_fp8_ragged_dot_sm90``, the weight gradients of the two
products on ``jax_tma_ragged_dot_sm90`` (bf16): 5 calls. FP8 rounds every operand of every
product to 3 mantissa bits (a few % relative per product), so the curves agree to FP8_TOLERANCE,
not to the bf16 one.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_tma
import jax_tma.flax

DTYPES = {"float32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# Largest relative difference of the two loss curves: both accumulate in fp32, their 16-bit
# outputs round differently now and then, and a token's top-k choice can flip on a near tie.
TOLERANCE = {"float32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}
# FP8 experts against bf16 ones (module docstring): the layer's output carries the products'
# ~5 % rounding, and the loss (its squared distance to the teacher) moves with it: 1.9 % apart at
# most over the default 300 steps (run through XLA, the kernels' math in another summation
# order); the bound leaves room for other seeds and sizes, not for a layer that does not learn.
FP8_TOLERANCE = 0.05
NUM_BATCHES = 8
AUX_LOSS_WEIGHT = 1e-2
# The grouped targets: jax_tma_ragged_dot_sm90, jax_tma_gated_ragged_dot_sm90,
# jax_tma_gated_ragged_grad_sm90 and jax_tma_fp8_ragged_dot_sm90.
_CALL_TARGET = re.compile(
    r'custom_call_target="(jax_tma_(?:gated_|fp8_)?ragged_(?:dot|grad)[^"]*)"')


class Model(nn.Module):
    """x + MoE(x): top-k routed SwiGLU experts and the residual."""

    experts: int
    top_k: int
    d_ff: int
    dtype: Any
    implementation: str = "jax_tma"
    expert_axis: str | None = None
    mesh: Any = None
    capacity_factor: float | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        moe = jax_tma.flax.MoE(num_experts=self.experts, top_k=self.top_k, hidden_dim=self.d_ff,
                               dtype=self.dtype, implementation=self.implementation,
                               expert_axis=self.expert_axis, mesh=self.mesh,
                               capacity_factor=self.capacity_factor, name="moe")
        return x + moe(x).astype(x.dtype)


def loss_fn(model: nn.Module) -> Callable:
    """(params, x, y) -> mean squared error + AUX_LOSS_WEIGHT * load-balancing loss."""
    def loss(params, x, y):
        out, state = model.apply(params, x, mutable=["intermediates"])
        balance = state["intermediates"]["moe"]["load_balancing_loss"][0]
        return jnp.mean((out - y) ** 2) + AUX_LOSS_WEIGHT * balance
    return loss


def expected_kernel_calls() -> int:
    """jax_tma's grouped calls per step, bf16 or FP8 alike. bf16: the gated forward (one call
    for gate and up) and the down projection's, the down projection's input gradient (the gated
    gradient call: the gate's and the up's cotangents from its epilogue), and the weight
    gradients of w_gate, w_up and w_down. FP8: the gate-and-up and the down product, the down
    product's input gradient and the three weight gradients."""
    return 6


def kernel_calls(fn: Callable, *args) -> int:
    """How many grouped kernel calls (ragged_dot's, gated_ragged_dot's and the gated
    gradient's) the compiled ``jax.jit(fn)(*args)`` makes (0 off GPU)."""
    return len(_CALL_TARGET.findall(jax.jit(fn).lower(*args).compile().as_text()))


@dataclasses.dataclass
class Setup:
    step: Callable  # (params, opt_state, x, y) -> (params, opt_state, loss)
    params: Any
    opt_state: Any
    batches: list[tuple[jax.Array, jax.Array]]


def setup(*, tokens: int = 2048, d_model: int = 256, d_ff: int = 512, experts: int = 8,
          top_k: int = 2, dtype: str = "bf16", use_tma: bool = True, fp8: bool = False,
          seed: int = 0, learning_rate: float = 1e-3) -> Setup:
    """Model, adam, data and the jitted step; the initial parameters depend only on ``seed``.
    ``fp8`` (with use_tma): the experts on the FP8 grouped kernel."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")

    def model(implementation):
        return Model(experts=experts, top_k=top_k, d_ff=d_ff, dtype=DTYPES[dtype],
                     implementation=implementation)

    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((NUM_BATCHES, tokens, d_model)).astype(np.float32)
    teacher = model("xla")
    teacher_params = teacher.init(jax.random.key(seed + 1), xs[0])
    ys = [np.asarray(jax.jit(teacher.apply)(teacher_params, x)) for x in xs]
    params = model("xla").init(jax.random.key(seed), xs[0])
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    loss = loss_fn(model(("jax_tma_fp8" if fp8 else "jax_tma") if use_tma else "xla"))

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys)]
    return Setup(step, params, opt_state, batches)


def run(s: Setup, steps: int) -> list[float]:
    """Runs ``steps`` training steps; the loss before each update."""
    params, opt_state, losses = s.params, s.opt_state, []
    for i in range(steps):
        x, y = s.batches[i % len(s.batches)]
        params, opt_state, loss = s.step(params, opt_state, x, y)
        losses.append(loss)
    return [float(v) for v in jax.device_get(losses)]


def max_relative_difference(curve: Sequence[float], reference: Sequence[float]) -> float:
    a, b = np.asarray(curve, np.float64), np.asarray(reference, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def model_arguments(p: argparse.ArgumentParser, steps: int = 300) -> None:
    """The layer's and the training run's options (examples/flax_moe_ep.py takes them too)."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)


def check_model_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.steps, args.tokens, args.d_model, args.d_ff, args.experts) < 1:
        p.error("--steps, --tokens, --d-model, --d-ff and --experts must be positive")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts={args.experts}]")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--fp8", action="store_true",
                   help="FP8 experts (implementation='jax_tma_fp8') against the bf16 kernels")
    args = p.parse_args(argv)
    check_model_arguments(p, args)
    if args.fp8 and args.dtype not in ("bf16", "float32"):
        p.error(f"--fp8 computes in bf16 or float32, not --dtype {args.dtype}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    status = jax_tma.kernel_status()
    print(f"device: {status.device} | jax {jax.__version__} | jax_tma kernel "
          f"{'available' if status.available else 'unavailable: ' + status.reason}")
    print(f"MoE: {args.tokens} tokens, d={args.d_model}, {args.experts} SwiGLU experts of "
          f"width {args.d_ff}, top-{args.top_k}, {args.dtype} experts, adam lr {args.lr}, "
          f"{args.steps} steps")
    config = dict(tokens=args.tokens, d_model=args.d_model, d_ff=args.d_ff,
                  experts=args.experts, top_k=args.top_k, dtype=args.dtype, seed=args.seed,
                  learning_rate=args.lr)
    # (name, use_tma, fp8): the run checked, then its reference.
    runs = ((("jax_tma_fp8", True, True), ("jax_tma", True, False)) if args.fp8
            else (("jax_tma", True, False), ("xla", False, False)))
    curves, calls = {}, {}
    for name, use_tma, fp8 in runs:
        s = setup(use_tma=use_tma, fp8=fp8, **config)
        calls[name] = kernel_calls(s.step, s.params, s.opt_state, *s.batches[0])
        start = time.perf_counter()
        curves[name] = run(s, args.steps)
        print(f"{name:11s} {time.perf_counter() - start:7.2f} s for {args.steps} steps "
              f"(first step compiles); grouped kernel calls per step: {calls[name]}")

    (ours, _, _), (ref, _, _) = runs
    print(f"\n{'step':>6} {'loss ' + ours:>16} {'loss ' + ref:>16}")
    marks = sorted({0, args.steps - 1, *range(0, args.steps, max(1, args.steps // 10))})
    for i in marks:
        print(f"{i:6d} {curves[ours][i]:16.6f} {curves[ref][i]:16.6f}")

    # FP8 runs its kernels in float32 too (the weight gradients always in bf16).
    kernels = status.available and (args.fp8 or args.dtype != "float32")
    expected = expected_kernel_calls() if kernels else 0
    print(f"\nkernel calls per step: {calls[ours]} ({expected} expected: "
          + ("the gate-and-up and the down product and the down product's input gradient in "
             "FP8, the two weight gradients in bf16)" if args.fp8 else
             "the gated and the down forward, the three weight gradients, input gradient of the "
             "down projection)"))
    diff = max_relative_difference(curves[ours], curves[ref])
    tol = FP8_TOLERANCE if args.fp8 else TOLERANCE[args.dtype]
    ok = diff <= tol and all(np.isfinite(curves[ours])) and calls[ours] == expected
    print(f"max relative difference of the loss curves: {diff:.3e} (tolerance {tol:.0e}); "
          f"first loss {curves[ref][0]:.4f}, last {curves[ref][-1]:.4f}: "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
