"""Expert parallelism for the Mixture-of-Experts layer of examples/flax_moe.py: the experts are
sharded over the devices of a mesh axis, the tokens too, and each (token, expert) pair travels
to the device holding its expert and back through ``lax.all_to_all`` inside ``jax.shard_map``.
Each device runs its own experts' products on ``jax_tma.ragged_dot``. Trained from the same
parameters on the same data as the one-device layer (flax_moe.MoE), the two loss curves must
agree within the dtype's tolerance.

    python examples/flax_moe_ep.py --devices 4           # 8 experts over 4 devices, 100 steps
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python examples/flax_moe_ep.py --devices 8 --steps 20

One step, on each device (T local tokens, E experts, E / n on each of n devices, top-k):
  1. route the local tokens (router weights replicated): k (expert, weight) pairs per token;
  2. sort the T * k pairs by expert, so each destination device's pairs are one run, and lay
     them out as [n, C, d] with C = T * k slots per destination (no pair is ever dropped, so the
     result is the one-device layer's exactly, up to summation order); all_to_all the rows,
     their local expert ids and the per-destination counts;
  3. sort the received rows by local expert (empty slots last), run the two grouped products
     ``ragged_dot(rows, w_in[local experts], group_sizes)`` and ``ragged_dot(h, w_out[...])``
     (rows past the groups come out zero), unsort, all_to_all the results back;
  4. mix each token's k results by its routing weights, add the residual.
The backward pass is jax's: all_to_all transposes to all_to_all, the replicated router's
gradient is summed over the devices. Capacity C = T * k is the simplest exact choice; a
production layer would cap it (dropping or re-routing overflow) to bound the exchange.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flax_moe  # noqa: E402

import jax_tma  # noqa: E402

AXIS = "ep"


def moe_expert_parallel(params, x, *, experts: int, top_k: int, dtype, devices: int):
    """The layer of flax_moe.MoE on the local tokens `x` [T, d] of one device of the mesh axis
    AXIS, with this device's E / n experts' weights in `params` (called inside shard_map)."""
    local_experts = experts // devices
    p = params["params"]
    tokens, d = x.shape
    pairs = tokens * top_k
    logits = x @ p["router"]["kernel"]
    scores, chosen = lax.top_k(logits, top_k)  # [T, k]
    weights = jax.nn.softmax(scores, axis=-1)
    # 2. Pairs sorted by expert; destination device = expert // local_experts.
    expert = chosen.reshape(-1)
    order = jnp.argsort(expert, stable=True)
    sorted_expert = expert[order]
    token = order // top_k
    dest = sorted_expert // local_experts
    sent = jnp.bincount(dest, length=devices).astype(jnp.int32)  # pairs per destination
    starts = jnp.cumsum(sent) - sent
    slot = jnp.arange(pairs) - starts[dest]  # position within the destination's run
    send_rows = jnp.zeros((devices, pairs, d), dtype).at[dest, slot].set(x[token].astype(dtype))
    send_ids = jnp.full((devices, pairs), local_experts, jnp.int32).at[dest, slot].set(
        sorted_expert - dest * local_experts)
    recv_rows = lax.all_to_all(send_rows, AXIS, 0, 0, tiled=False)
    recv_ids = lax.all_to_all(send_ids, AXIS, 0, 0, tiled=False)
    # 3. This device's experts over everything it received; empty slots (id local_experts) last.
    rows = recv_rows.reshape(devices * pairs, d)
    ids = recv_ids.reshape(-1)
    by_expert = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    w_in = p["w_in"].astype(dtype)
    w_out = p["w_out"].astype(dtype)
    h = jax.nn.gelu(jax_tma.ragged_dot(rows[by_expert], w_in, group_sizes))
    y_sorted = jax_tma.ragged_dot(h, w_out, group_sizes)
    y = jnp.zeros_like(y_sorted).at[by_expert].set(y_sorted).reshape(devices, pairs, d)
    back = lax.all_to_all(y, AXIS, 0, 0, tiled=False)  # back[dest, slot]: my pairs' results
    # 4. Mix and add the residual.
    y_pair = back[dest, slot].astype(jnp.float32)
    mix = weights.reshape(-1)[order][:, None]
    return x + jnp.zeros_like(x).at[token].add(mix * y_pair)


def setup_expert_parallel(mesh: Mesh, *, tokens, d_model, d_ff, experts, top_k, dtype, seed,
                          learning_rate):
    """flax_moe.setup's model, data and initial parameters, with the layer expert-parallel over
    `mesh`: tokens and experts sharded on AXIS, the router replicated."""
    one = flax_moe.setup(tokens=tokens, d_model=d_model, d_ff=d_ff, experts=experts,
                         top_k=top_k, dtype=dtype, use_tma=True, seed=seed,
                         learning_rate=learning_rate)
    devices = mesh.shape[AXIS]
    param_specs = {"params": {"router": {"kernel": P()}, "w_in": P(AXIS), "w_out": P(AXIS)}}
    layer = jax.shard_map(
        functools.partial(moe_expert_parallel, experts=experts, top_k=top_k,
                          dtype=flax_moe.DTYPES[dtype], devices=devices),
        mesh=mesh, in_specs=(param_specs, P(AXIS)), out_specs=P(AXIS))
    optimizer = optax.adam(learning_rate)

    def loss_fn(params, x, y):
        return jnp.mean((layer(params, x) - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    params = jax.device_put(one.params, jax.tree.map(shard, param_specs))
    opt_state = optimizer.init(params)
    batches = [(jax.device_put(x, shard(P(AXIS))), jax.device_put(y, shard(P(AXIS))))
               for x, y in one.batches]
    return one, flax_moe.Setup(step, params, opt_state, batches)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=min(4, jax.device_count()))
    flax_moe.model_arguments(p, steps=100)
    args = p.parse_args(argv)
    flax_moe.check_model_arguments(p, args)
    if not 1 <= args.devices <= jax.device_count():
        p.error(f"--devices must be in [1, {jax.device_count()}] (the devices visible)")
    if args.experts % args.devices or args.tokens % args.devices:
        p.error(f"--experts ({args.experts}) and --tokens ({args.tokens}) must be multiples of "
                f"--devices ({args.devices})")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    mesh = Mesh(np.array(jax.devices()[:args.devices]), (AXIS,))
    status = jax_tma.kernel_status()
    print(f"devices: {args.devices} x {jax.devices()[0].device_kind} | jax {jax.__version__} | "
          f"jax_tma kernel {'available' if status.available else 'unavailable: ' + status.reason}")
    print(f"MoE: {args.tokens} tokens, d={args.d_model}, {args.experts} experts "
          f"({args.experts // args.devices} per device) of {args.d_model}->{args.d_ff}->"
          f"{args.d_model}, top-{args.top_k}, {args.dtype}, {args.steps} adam steps")
    one, ep = setup_expert_parallel(
        mesh, tokens=args.tokens, d_model=args.d_model, d_ff=args.d_ff, experts=args.experts,
        top_k=args.top_k, dtype=args.dtype, seed=args.seed, learning_rate=args.lr)
    curves, seconds = {}, {}
    for name, s in (("one device", one), ("expert-parallel", ep)):
        flax_moe.run(s, 1)  # compile
        start = time.perf_counter()
        curves[name] = flax_moe.run(s, args.steps)
        seconds[name] = (time.perf_counter() - start) / args.steps
        print(f"{name:16s} {seconds[name] * 1e3:8.2f} ms per step")
    hlo = ep.step.lower(ep.params, ep.opt_state, *ep.batches[0]).as_text()
    exchanges = hlo.count("all_to_all") + hlo.count("all-to-all")
    print(f"\n{'step':>6} {'one device':>14} {'expert-parallel':>16}")
    for i in sorted({0, args.steps - 1, *range(0, args.steps, max(1, args.steps // 10))}):
        print(f"{i:6d} {curves['one device'][i]:14.6f} {curves['expert-parallel'][i]:16.6f}")
    diff = flax_moe.max_relative_difference(curves["expert-parallel"], curves["one device"])
    tol = flax_moe.TOLERANCE[args.dtype]
    # NOTE: over one device the exchange is the identity, and XLA removes it.
    ok = (diff <= tol and all(np.isfinite(curves["expert-parallel"]))
          and (exchanges > 0 or args.devices == 1))
    print(f"\nall_to_all ops in the step: {exchanges}; max relative difference of the loss "
          f"curves: {diff:.3e} (tolerance {tol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
