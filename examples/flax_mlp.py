"""Train one small Flax MLP twice, through ``jax_tma.dot_general`` and through
``jax.lax.dot_general``, from the same initial parameters on the same data, and compare the
loss curves.

    python examples/flax_mlp.py                      # bf16 layers, 300 adam steps
    python examples/flax_mlp.py --steps 1000 --batch 1024 --hidden 1024 --dtype fp16
    python examples/flax_mlp.py --devices 2          # data parallel over 2 GPUs

The task is regression onto a fixed random teacher network (tanh, standard-normal inputs).
Parameters and optimizer state are float32; ``--dtype bf16`` or ``fp16`` makes every
``nn.Dense`` compute in that dtype (flax ``dtype=``), so its operands are what the Hopper kernel
takes: on an H100/H200 the forward product and both gradient products of every layer run
``jax_tma_gemm_sm90`` (the first layer has no input gradient, so 3 * layers - 1 calls per
step). ``--devices N`` shards each batch over a 1-D mesh of N devices, parameters replicated.

Prints a summary of both curves, their largest relative difference and, per run, how many
jax_tma custom calls the compiled training step holds. Exit status 1 when the curves differ by
more than the tolerance of the dtype (``TOLERANCE``).
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_tma

DTYPES = {"float32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# Largest relative difference |loss_tma - loss_xla| / loss_xla allowed over the whole curve.
# Both runs accumulate in fp32; in 16-bit dtypes their outputs round differently now and then,
# and the two trajectories drift apart by that much, not more.
TOLERANCE = {"float32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}
IN_FEATURES = 64
OUT_FEATURES = 16
TEACHER_HIDDEN = 64
NUM_BATCHES = 16  # distinct batches, cycled through
_CALL_TARGET = re.compile(r'custom_call_target="(jax_tma_[^"]*)"')


class MLP(nn.Module):
    """``depth`` hidden Dense + gelu layers of width ``hidden``, then a Dense head."""

    hidden: int
    depth: int
    out: int
    dtype: Any
    dot_general: Callable

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.depth):
            x = nn.Dense(self.hidden, dtype=self.dtype, dot_general=self.dot_general,
                         name=f"hidden_{i}")(x)
            x = nn.gelu(x)
        return nn.Dense(self.out, dtype=self.dtype, dot_general=self.dot_general,
                        name="head")(x)


def dense_layers(depth: int) -> int:
    return depth + 1


def expected_kernel_calls(depth: int) -> int:
    """jax_tma calls per training step when every product runs the kernel: forward, input
    gradient and weight gradient of each Dense, less the first layer's input gradient."""
    return 3 * dense_layers(depth) - 1


def kernel_calls(fn: Callable, *args) -> int:
    """How many jax_tma custom calls the compiled ``jax.jit(fn)(*args)`` makes (0 off GPU)."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return len(_CALL_TARGET.findall(hlo))


def _dataset(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """NUM_BATCHES batches of (inputs, teacher outputs), float32, targets of unit variance."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((IN_FEATURES, TEACHER_HIDDEN)) / np.sqrt(IN_FEATURES)
    w2 = rng.standard_normal((TEACHER_HIDDEN, OUT_FEATURES)) / np.sqrt(TEACHER_HIDDEN)
    x = rng.standard_normal((NUM_BATCHES, batch, IN_FEATURES))
    y = np.tanh(2.0 * x @ w1) @ w2
    y /= y.std()
    return x.astype(np.float32), y.astype(np.float32)


@dataclasses.dataclass
class Setup:
    """A jitted training step and everything it starts from."""

    step: Callable  # (params, opt_state, x, y) -> (params, opt_state, loss)
    params: Any
    opt_state: Any
    batches: list[tuple[jax.Array, jax.Array]]
    # NOTE: XLA's CPU collectives can deadlock when several sharded steps are queued on a
    # machine with few cores (a rendezvous waits for a device whose threads are all busy), so
    # on CPU meshes each step waits for the previous one.
    sync_each_step: bool = False


def setup(*, batch: int = 256, hidden: int = 512, depth: int = 2, dtype: str = "bf16",
          use_tma: bool = True, devices: int = 1, seed: int = 0,
          learning_rate: float = 1e-3) -> Setup:
    """Model, adam, data and the jitted step. Initial parameters depend only on ``seed`` (not
    on ``use_tma``), so both runs start from the same point on the same data."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if devices < 1 or batch % devices:
        raise ValueError(f"batch {batch} must be a positive multiple of devices {devices}")
    available = jax.devices()
    if devices > len(available):
        raise ValueError(f"--devices {devices}: only {len(available)} device(s) visible")
    mesh = Mesh(np.asarray(available[:devices]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded = NamedSharding(mesh, PartitionSpec("data"))

    def model(dot_general):
        return MLP(hidden=hidden, depth=depth, out=OUT_FEATURES, dtype=DTYPES[dtype],
                   dot_general=dot_general)

    xs, ys = _dataset(batch, seed)
    params = model(jax.lax.dot_general).init(jax.random.key(seed), xs[0])
    params = jax.device_put(params, replicated)
    optimizer = optax.adam(learning_rate)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    net = model(jax_tma.dot_general if use_tma else jax.lax.dot_general)

    def loss_fn(params, x, y):
        pred = net.apply(params, x).astype(jnp.float32)
        return jnp.mean((pred - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = [(jax.device_put(x, sharded), jax.device_put(y, sharded)) for x, y in zip(xs, ys)]
    sync = devices > 1 and available[0].platform == "cpu"
    return Setup(step, params, opt_state, batches, sync_each_step=sync)


def run(s: Setup, steps: int) -> list[float]:
    """Runs ``steps`` training steps; the loss before each update."""
    params, opt_state, losses = s.params, s.opt_state, []
    for i in range(steps):
        x, y = s.batches[i % len(s.batches)]
        params, opt_state, loss = s.step(params, opt_state, x, y)
        if s.sync_each_step:
            loss.block_until_ready()
        losses.append(loss)
    return [float(v) for v in jax.device_get(losses)]


def train(steps: int, *, batch: int = 256, hidden: int = 512, depth: int = 2,
          dtype: str = "bf16", use_tma: bool = True, devices: int = 1, seed: int = 0,
          learning_rate: float = 1e-3) -> list[float]:
    """Loss curve of ``steps`` adam steps, with jax_tma.dot_general (``use_tma``) or the
    default dot_general in every Dense layer."""
    s = setup(batch=batch, hidden=hidden, depth=depth, dtype=dtype, use_tma=use_tma,
              devices=devices, seed=seed, learning_rate=learning_rate)
    return run(s, steps)


def max_relative_difference(curve: Sequence[float], reference: Sequence[float]) -> float:
    a = np.asarray(curve, np.float64)
    b = np.asarray(reference, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256, help="global batch (all devices)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="compute dtype of the Dense layers (parameters stay float32)")
    p.add_argument("--devices", type=int, default=1, help="data-parallel devices")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.hidden < 1 or args.depth < 0:
        p.error("--steps and --hidden must be positive, --depth non-negative")
    if args.devices < 1 or args.batch < 1 or args.batch % args.devices:
        p.error(f"--batch ({args.batch}) must be a positive multiple of --devices "
                f"({args.devices})")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    status = jax_tma.kernel_status()
    print(f"device: {status.device} x {args.devices} | jax {jax.__version__} | "
          f"jax_tma kernel {'available' if status.available else 'unavailable: ' + status.reason}")
    print(f"MLP {IN_FEATURES} -> {args.depth} x {args.hidden} -> {OUT_FEATURES}, "
          f"{args.dtype} layers, float32 params, adam lr {args.lr}, batch {args.batch}, "
          f"{args.steps} steps")
    config = dict(batch=args.batch, hidden=args.hidden, depth=args.depth, dtype=args.dtype,
                  devices=args.devices, seed=args.seed, learning_rate=args.lr)
    curves, calls = {}, {}
    for name, use_tma in (("jax_tma", True), ("xla", False)):
        s = setup(use_tma=use_tma, **config)
        calls[name] = kernel_calls(s.step, s.params, s.opt_state, *s.batches[0])
        start = time.perf_counter()
        curves[name] = run(s, args.steps)
        print(f"{name:8s} {time.perf_counter() - start:7.2f} s for {args.steps} steps "
              f"(first step compiles); jax_tma custom calls per step: {calls[name]}")

    print(f"\n{'step':>6} {'loss jax_tma':>14} {'loss xla':>14}")
    marks = sorted({0, args.steps - 1, *range(0, args.steps, max(1, args.steps // 10))})
    for i in marks:
        print(f"{i:6d} {curves['jax_tma'][i]:14.6f} {curves['xla'][i]:14.6f}")

    kernel_expected = status.available and args.dtype in ("bf16", "fp16")
    expected = expected_kernel_calls(args.depth) if kernel_expected else 0
    path = "Hopper kernel" if calls["jax_tma"] else "XLA"
    print(f"\npath taken by jax_tma.dot_general: {path} ({calls['jax_tma']} kernel calls per "
          f"step; {expected} expected)")
    if calls["jax_tma"] != expected:
        print(f"WARNING: expected {expected} jax_tma calls per step, found {calls['jax_tma']}")

    diff = max_relative_difference(curves["jax_tma"], curves["xla"])
    tol = TOLERANCE[args.dtype]
    ok = diff <= tol and all(np.isfinite(curves["jax_tma"]))
    print(f"max relative difference of the loss curves: {diff:.3e} (tolerance {tol:.0e}): "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
