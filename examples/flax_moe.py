"""Train a small Flax Mixture-of-Experts layer twice, with the experts' products on
``jax_tma.ragged_dot`` and on ``jax.lax.ragged_dot``, from the same initial parameters on the
same data, and compare the loss curves.

    python examples/flax_moe.py                    # 8 experts, top-2, bf16, 300 adam steps
    python examples/flax_moe.py --experts 64 --top-k 4 --tokens 8192 --d-model 1024 --d-ff 2048

The layer: a linear router scores every token against every expert, each token goes to its
top-k experts (softmax over the k chosen scores gives the mixing weights), the (token, expert)
pairs are sorted by expert so each expert's tokens are one contiguous run of rows, and every
expert applies its own MLP d -> f -> d (gelu) to its run: two grouped products,
``ragged_dot(rows [T*k, d], w_in [E, d, f], group_sizes)`` and ``ragged_dot(h, w_out [E, f, d],
group_sizes)``, with group sizes counted on the device. Outputs are mixed back per token, plus
the residual. Parameters and adam state are float32; the experts compute in ``--dtype``.

The task is regression onto a fixed random teacher of the same shape. On an H100/H200 each
expert projection's forward product, weight gradient and (for the second) input gradient is one
``jax_tma_ragged_dot_sm90`` call: 5 per training step (the first projection's input gradient
feeds only the data, which is not trained, and XLA removes it). The script prints both curves,
their largest relative difference and the kernel calls per compiled step; exit status 1 when
the curves differ by more than the dtype's tolerance or the call count is not the expected one.
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
from jax import lax

import jax_tma

DTYPES = {"float32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# Largest relative difference of the two loss curves: both accumulate in fp32, their 16-bit
# outputs round differently now and then, and a token's top-k choice can flip on a near tie.
TOLERANCE = {"float32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}
NUM_BATCHES = 8
_CALL_TARGET = re.compile(r'custom_call_target="(jax_tma_ragged_dot[^"]*)"')


class MoE(nn.Module):
    """Top-k routed experts, each a gelu MLP d -> f -> d, plus the residual."""

    experts: int
    top_k: int
    d_ff: int
    dtype: Any
    ragged_dot: Callable  # jax_tma.ragged_dot or lax.ragged_dot

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        tokens, d = x.shape
        logits = nn.Dense(self.experts, use_bias=False, name="router")(x)
        scores, chosen = lax.top_k(logits, self.top_k)  # [T, k]
        weights = jax.nn.softmax(scores, axis=-1)
        # (token, slot) pairs sorted by expert: each expert's rows are one run.
        expert = chosen.reshape(-1)
        order = jnp.argsort(expert, stable=True)
        token = order // self.top_k
        group_sizes = jnp.bincount(expert, length=self.experts).astype(jnp.int32)
        rows = x[token].astype(self.dtype)
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (self.experts, d, self.d_ff)).astype(self.dtype)
        w_out = self.param("w_out", init, (self.experts, self.d_ff, d)).astype(self.dtype)
        h = nn.gelu(self.ragged_dot(rows, w_in, group_sizes))
        y = self.ragged_dot(h, w_out, group_sizes).astype(jnp.float32)
        mix = weights.reshape(-1)[order][:, None]
        return x + jnp.zeros_like(x).at[token].add(mix * y)


def expected_kernel_calls() -> int:
    """jax_tma calls per step: forward and weight gradient of both projections, and the input
    gradient of the second."""
    return 5


def kernel_calls(fn: Callable, *args) -> int:
    """How many ragged_dot kernel calls the compiled ``jax.jit(fn)(*args)`` makes (0 off GPU)."""
    return len(_CALL_TARGET.findall(jax.jit(fn).lower(*args).compile().as_text()))


@dataclasses.dataclass
class Setup:
    step: Callable  # (params, opt_state, x, y) -> (params, opt_state, loss)
    params: Any
    opt_state: Any
    batches: list[tuple[jax.Array, jax.Array]]


def setup(*, tokens: int = 2048, d_model: int = 256, d_ff: int = 512, experts: int = 8,
          top_k: int = 2, dtype: str = "bf16", use_tma: bool = True, seed: int = 0,
          learning_rate: float = 1e-3) -> Setup:
    """Model, adam, data and the jitted step; the initial parameters depend only on ``seed``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")

    def model(ragged_dot):
        return MoE(experts=experts, top_k=top_k, d_ff=d_ff, dtype=DTYPES[dtype],
                   ragged_dot=ragged_dot)

    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((NUM_BATCHES, tokens, d_model)).astype(np.float32)
    teacher = model(lax.ragged_dot)
    teacher_params = teacher.init(jax.random.key(seed + 1), xs[0])
    ys = [np.asarray(jax.jit(teacher.apply)(teacher_params, x)) for x in xs]
    params = model(lax.ragged_dot).init(jax.random.key(seed), xs[0])
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    net = model(jax_tma.ragged_dot if use_tma else lax.ragged_dot)

    def loss_fn(params, x, y):
        return jnp.mean((net.apply(params, x) - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

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
    args = p.parse_args(argv)
    check_model_arguments(p, args)
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    status = jax_tma.kernel_status()
    print(f"device: {status.device} | jax {jax.__version__} | jax_tma kernel "
          f"{'available' if status.available else 'unavailable: ' + status.reason}")
    print(f"MoE: {args.tokens} tokens, d={args.d_model}, {args.experts} experts of "
          f"{args.d_model}->{args.d_ff}->{args.d_model}, top-{args.top_k}, {args.dtype} experts, "
          f"adam lr {args.lr}, {args.steps} steps")
    config = dict(tokens=args.tokens, d_model=args.d_model, d_ff=args.d_ff,
                  experts=args.experts, top_k=args.top_k, dtype=args.dtype, seed=args.seed,
                  learning_rate=args.lr)
    curves, calls = {}, {}
    for name, use_tma in (("jax_tma", True), ("xla", False)):
        s = setup(use_tma=use_tma, **config)
        calls[name] = kernel_calls(s.step, s.params, s.opt_state, *s.batches[0])
        start = time.perf_counter()
        curves[name] = run(s, args.steps)
        print(f"{name:8s} {time.perf_counter() - start:7.2f} s for {args.steps} steps "
              f"(first step compiles); ragged_dot kernel calls per step: {calls[name]}")

    print(f"\n{'step':>6} {'loss jax_tma':>14} {'loss xla':>14}")
    marks = sorted({0, args.steps - 1, *range(0, args.steps, max(1, args.steps // 10))})
    for i in marks:
        print(f"{i:6d} {curves['jax_tma'][i]:14.6f} {curves['xla'][i]:14.6f}")

    expected = expected_kernel_calls() if status.available and args.dtype != "float32" else 0
    print(f"\nkernel calls per step: {calls['jax_tma']} ({expected} expected: forward and weight "
          "gradient of both projections, input gradient of the second)")
    diff = max_relative_difference(curves["jax_tma"], curves["xla"])
    tol = TOLERANCE[args.dtype]
    ok = diff <= tol and all(np.isfinite(curves["jax_tma"])) and calls["jax_tma"] == expected
    print(f"max relative difference of the loss curves: {diff:.3e} (tolerance {tol:.0e}); "
          f"first loss {curves['xla'][0]:.4f}, last {curves['xla'][-1]:.4f}: "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
