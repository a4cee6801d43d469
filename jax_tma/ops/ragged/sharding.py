"""Sharding of ``jax_tma.ragged_dot``: ``custom_partitioning`` with a Shardy rule.

The primitive's operands are x [B, M, K], w [Bw, G, K, N] (or [Bw, G, N, K]) in the rows mode
or dy [B, M, N] in the contraction mode, and group sizes [Bg, G] (Bw, Bg: 1 or B). Each device
runs the kernel on its shards:

- the batch B, and N (rows mode: w's columns; contraction mode: dy's columns), and K in the
  contraction mode (x's columns, the output's rows) keep the operands' sharding: no
  communication;
- M, the tokens: each device holds a contiguous share of the rows, sorted by group like the
  whole. Its local group sizes are the overlap of each group's rows with its share, computed on
  the device from the global sizes. Rows mode: the output rows stay sharded; contraction mode:
  M is contracted, and the per-device products are summed with ``psum``;
- K in the rows mode is contracted locally and summed with ``psum``;
- G (the weights' group dimension) is never split: each device needs every group's weights.

Partial products are summed in fp32 when the output is 16-bit. A mesh axis is used once: the
batch claims it first, then M, N and K.

The gated rows form (gated_ragged_dot) shares the rows mode's rules but for K, which it never
splits; so does the gated gradient rows form (gated_ragged_mlp's backward), which never splits
dy's D; and the FP8 rows form (fp8_ragged_dot, at the end), which splits neither K nor N (its
block scales are 128 deep and 128 wide).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_tma._core.sharding import Axes, AxisClaims, Params, partitioned_call, spec_of
from jax_tma.ops.ragged.config import clamp_sizes


def _spec(dims) -> PartitionSpec:
    return PartitionSpec(*(d if len(d) > 1 else (d[0] if d else None) for d in dims))


def _choose(mesh, mode, w_k_major, shapes, specs):
    """Mesh axes per factor (b, m, k, n) from the operands' shardings, and the shardings of
    every operand and of the output that follow."""
    (x_shape, w_shape, gs_shape), (x_spec, w_spec, _) = shapes, specs
    claim = AxisClaims(mesh)

    w_batched = w_shape[0] == x_shape[0] and (mode != "rows" or w_shape[0] > 1)
    gs_batched = gs_shape[0] == x_shape[0] and gs_shape[0] > 1
    b = claim(x_spec[0] or (w_spec[0] if w_batched else ()), x_shape[0])
    if mode == "rows":
        k_axis, n_axis = (3, 2) if w_k_major else (2, 3)
        m = claim(x_spec[1], x_shape[1])
        n = claim(w_spec[n_axis], w_shape[n_axis])
        k = claim(x_spec[2] or w_spec[k_axis], x_shape[2])
        w_out = [b if w_batched else (), (), (), ()]
        w_out[k_axis], w_out[n_axis] = k, n
        out = (b, m, n)
        reduce_axes = k
    else:
        m = claim(x_spec[1] or w_spec[1], x_shape[1])
        k = claim(x_spec[2], x_shape[2])
        n = claim(w_spec[2], w_shape[2])
        w_out = [b, m, n]
        out = (b, (), k, n)
        reduce_axes = m
    return dict(b=b, m=m, k=k, n=n, x=(b, m, k), w=tuple(w_out),
                gs=(b if gs_batched else (), ()), out=out, reduce=reduce_axes)


def _choose_for(mesh, mode, w_k_major, arg_shapes):
    shapes = tuple(a.shape for a in arg_shapes)
    specs = tuple(spec_of(a.sharding, len(a.shape)) for a in arg_shapes)
    return _choose(mesh, mode, w_k_major, shapes, specs)


def local_group_sizes(group_sizes: jax.Array, rows: int, shard: jax.Array,
                      shard_rows: int) -> jax.Array:
    """Rows of each group that fall in rows [shard * shard_rows, (shard + 1) * shard_rows) of
    `rows`, groups laid out one after another from row 0 (sizes clamped to [0, rows], the
    running sum saturating at rows, as the kernel reads them)."""
    sizes = clamp_sizes(group_sizes, rows).astype(jnp.uint32)
    limit = jnp.uint32(rows)
    # Saturating addition on [0, rows] is associative; two values below 2^31 add without wrap.
    ends = lax.associative_scan(lambda a, b: jnp.minimum(a + b, limit), sizes, axis=-1)
    starts = ends - jnp.minimum(sizes, ends)
    first = shard.astype(jnp.int32) * shard_rows  # below rows < 2^31

    def local(v):
        return jnp.clip(v.astype(jnp.int32) - first, 0, shard_rows)

    return (local(ends) - local(starts)).astype(jnp.int32)


def _shard_index(axes: Axes) -> jax.Array:
    index = jnp.int32(0)
    for a in axes:
        index = index * lax.axis_size(a) + lax.axis_index(a)
    return index


def _row_shards(mesh, choice, rows: int,
                keys: tuple[str, ...] = ("x", "w", "gs")) -> tuple[bool, Callable]:
    """(whether any operand of the choice, named by `keys`, is split; group sizes -> this
    device's): the rows of each group that fall in the device's shard of M where M is split."""
    m_axes = choice["m"]
    sharded = any(any(d) for key in keys for d in choice[key])
    if not m_axes:
        return sharded, lambda gs: gs
    shard_rows = rows // math.prod(mesh.shape[a] for a in m_axes)
    return sharded, lambda gs: local_group_sizes(gs, rows, _shard_index(m_axes), shard_rows)


def _infer(local_op, mode, w_k_major, out_dtype, config, mesh, arg_shapes, result_shape):
    del local_op, out_dtype, config, result_shape
    choice = _choose_for(mesh, mode, w_k_major, arg_shapes)
    return NamedSharding(mesh, _spec(choice["out"]))


def _partition(local_op, mode, w_k_major, out_dtype, config, mesh, arg_shapes, result_shape):
    del result_shape
    choice = _choose_for(mesh, mode, w_k_major, arg_shapes)
    sharded, local_sizes = _row_shards(mesh, choice, arg_shapes[0].shape[1])
    local_config = None if sharded else config
    out_dtype = jnp.dtype(out_dtype)
    reduce_axes = choice["reduce"]
    acc_dtype = (jnp.dtype(jnp.float32) if reduce_axes and out_dtype.itemsize < 4
                 else out_dtype)

    def per_device(x, w, gs):
        out = local_op(x, w, local_sizes(gs), mode, w_k_major, acc_dtype, local_config)
        if reduce_axes:
            out = lax.psum(out, reduce_axes)
        return out.astype(out_dtype)

    arg_shardings = tuple(NamedSharding(mesh, _spec(choice[key])) for key in ("x", "w", "gs"))
    return mesh, per_device, NamedSharding(mesh, _spec(choice["out"])), arg_shardings


def _batch_factors(batch: int, w_t, gs_t, w_mapped_at_1: bool = False) -> tuple[str, str]:
    """The Shardy factors of the weights' and the group sizes' batch dims: the operands' "b"
    where they are mapped with x, else one of their own (shared: size 1). `w_mapped_at_1`: the
    weights' batch of 1 is x's too (the contraction form's second operand)."""
    wb = "b" if w_t.shape[0] == batch and (w_mapped_at_1 or batch > 1) else "wb"
    gb = "b" if gs_t.shape[0] == batch and batch > 1 else "gb"
    return wb, gb


def _sharding_rule(local_op, mode, w_k_major, out_dtype, config, mesh, operand_types,
                   result_types):
    """Einsum-like factors b, m, k, n, g; a batch dim of size 1 (shared) gets its own factor."""
    del local_op, out_dtype, config, mesh, result_types
    x_t, w_t, gs_t = operand_types
    batch = x_t.shape[0]
    wb, gb = _batch_factors(batch, w_t, gs_t, w_mapped_at_1=mode != "rows")
    if mode == "rows":
        w = f"{wb} g n k" if w_k_major else f"{wb} g k n"
        rule = f"b m k, {w}, {gb} g -> b m n"
        return rule, dict(reduction_factors=("k",), need_replication_factors=("g",))
    rule = f"b m k, b m n, {gb} g -> b g k n"
    return rule, dict(reduction_factors=("m",), need_replication_factors=("g",))


@functools.partial(custom_partitioning, static_argnums=(3, 4, 5, 6, 7))
def _partitioned(x, w, gs, local_op, mode, w_k_major, out_dtype, config):
    return local_op(x, w, gs, mode, w_k_major, out_dtype, config)


_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer,
    sharding_rule=_sharding_rule,
)


def partitioned_ragged_dot(x: jax.Array, w: jax.Array, gs: jax.Array, *, local_op: Callable,
                           mode: str, w_k_major: bool, out_dtype, config) -> jax.Array:
    """``local_op(x, w, gs, mode, w_k_major, out_dtype, config)`` under the partitioning rules
    above: each device runs local_op on its shards."""
    return _partitioned(x, w, gs, local_op, mode, bool(w_k_major), jnp.dtype(out_dtype), config)


# ---------------------------------------------------------------- the gated rows form
# Operands x [B, M, K], w_gate and w_up [Bw, G, K, F], group sizes [Bg, G]; results out
# [B, M, F] and (save_pre) pre [2, B, M, F]. The batch, M (with local group sizes, as above)
# and F keep the operands' sharding; K is never split (the activation of a partial sum is not
# the partial sum of the activation: a sharded K is gathered first), nor G.


def _choose_gated(mesh, arg_shapes):
    x, wg, _, gs = arg_shapes
    x_spec, w_spec = spec_of(x.sharding, 3), spec_of(wg.sharding, 4)
    claim = AxisClaims(mesh)
    w_batched = wg.shape[0] == x.shape[0] and wg.shape[0] > 1
    b = claim(x_spec[0] or (w_spec[0] if w_batched else ()), x.shape[0])
    m = claim(x_spec[1], x.shape[1])
    f = claim(w_spec[3], wg.shape[3])
    w = (b if w_batched else (), (), (), f)
    gs_batched = gs.shape[0] == x.shape[0] and gs.shape[0] > 1
    return dict(b=b, m=m, x=(b, m, ()), w=w, gs=(b if gs_batched else (), ()),
                out=(b, m, f), pre=((), b, m, f))


def _gated_results(mesh, choice, params):
    results = [NamedSharding(mesh, _spec(choice["out"]))]
    if params["save_pre"]:
        results.append(NamedSharding(mesh, _spec(choice["pre"])))
    return results


def _infer_gated(local_op, params, mesh, arg_shapes, result_shape):
    del local_op, result_shape
    return _gated_results(mesh, _choose_gated(mesh, arg_shapes), params)


def _partition_gated(local_op, params, mesh, arg_shapes, result_shape):
    del result_shape
    choice = _choose_gated(mesh, arg_shapes)
    sharded, local_sizes = _row_shards(mesh, choice, arg_shapes[0].shape[1])
    local_params = dict(params, config=None) if sharded else dict(params)

    def per_device(x, wg, wu, gs):
        return local_op(x, wg, wu, local_sizes(gs), **local_params)

    w = NamedSharding(mesh, _spec(choice["w"]))
    arg_shardings = (NamedSharding(mesh, _spec(choice["x"])), w, w,
                     NamedSharding(mesh, _spec(choice["gs"])))
    return mesh, per_device, _gated_results(mesh, choice, params), arg_shardings


def _gated_sharding_rule(local_op, params, mesh, operand_types, result_types):
    """Factors b, m, k, f, g; k and g are never split. A batch dim of size 1 (shared) gets its
    own factor."""
    del local_op, mesh, result_types
    x_t, w_t, _, gs_t = operand_types
    batch = x_t.shape[0]
    wb, gb = _batch_factors(batch, w_t, gs_t)
    outs = "b m f, p b m f" if params["save_pre"] else "b m f"
    rule = f"b m k, {wb} g k f, {wb} g k f, {gb} g -> {outs}"
    return rule, dict(need_replication_factors=("k", "g"))


_partitioned_gated = partitioned_call(partition=_partition_gated,
                                      infer_sharding_from_operands=_infer_gated,
                                      sharding_rule=_gated_sharding_rule, num_static=2)


def partitioned_gated_ragged_dot(x: jax.Array, wg: jax.Array, wu: jax.Array, gs: jax.Array, *,
                                 local_op: Callable, params: dict) -> list[jax.Array]:
    """``local_op(x, wg, wu, gs, **params)`` (the gated primitive's local product) under the
    partitioning rules above."""
    params = Params.static(params)
    return _partitioned_gated(local_op, params, x, wg, wu, gs)


# ---------------------------------------------------------------- the gated gradient rows form
# Operands dy [B, M, D], w_down [Bw, G, F, D], group sizes [Bg, G], pre [2, B, M, F]; results
# d_gate and d_up [B, M, F] (gated_ragged_mlp's backward). The batch, M (with local group sizes,
# as above) and F keep the operands' sharding; D is never split (the cotangents are not linear in
# a partial dh), nor G.


def _choose_gated_grad(mesh, arg_shapes):
    dy, wd, gs, pre = arg_shapes
    dy_spec, w_spec = spec_of(dy.sharding, 3), spec_of(wd.sharding, 4)
    pre_spec = spec_of(pre.sharding, 4)
    claim = AxisClaims(mesh)
    w_batched = wd.shape[0] == dy.shape[0] and wd.shape[0] > 1
    b = claim(dy_spec[0] or pre_spec[1] or (w_spec[0] if w_batched else ()), dy.shape[0])
    m = claim(dy_spec[1] or pre_spec[2], dy.shape[1])
    f = claim(pre_spec[3] or w_spec[2], wd.shape[2])
    gs_batched = gs.shape[0] == dy.shape[0] and gs.shape[0] > 1
    return dict(m=m, x=(b, m, ()), w=(b if w_batched else (), (), f, ()),
                gs=(b if gs_batched else (), ()), pre=((), b, m, f), out=(b, m, f))


def _infer_gated_grad(local_op, params, mesh, arg_shapes, result_shape):
    del local_op, params, result_shape
    out = NamedSharding(mesh, _spec(_choose_gated_grad(mesh, arg_shapes)["out"]))
    return [out, out]


def _partition_gated_grad(local_op, params, mesh, arg_shapes, result_shape):
    del result_shape
    choice = _choose_gated_grad(mesh, arg_shapes)
    keys = ("x", "w", "gs", "pre")
    sharded, local_sizes = _row_shards(mesh, choice, arg_shapes[0].shape[1], keys)
    local_params = dict(params, config=None) if sharded else dict(params)

    def per_device(dy, wd, gs, pre):
        return local_op(dy, wd, local_sizes(gs), pre, **local_params)

    out = NamedSharding(mesh, _spec(choice["out"]))
    arg_shardings = tuple(NamedSharding(mesh, _spec(choice[key])) for key in keys)
    return mesh, per_device, [out, out], arg_shardings


def _gated_grad_sharding_rule(local_op, params, mesh, operand_types, result_types):
    """Factors b, m, d, f, g; d and g are never split. A batch dim of size 1 (shared) gets its
    own factor."""
    del local_op, params, mesh, result_types
    dy_t, w_t, gs_t, _ = operand_types
    batch = dy_t.shape[0]
    wb, gb = _batch_factors(batch, w_t, gs_t)
    rule = f"b m d, {wb} g f d, {gb} g, p b m f -> b m f, b m f"
    return rule, dict(need_replication_factors=("d", "g"))


_partitioned_gated_grad = partitioned_call(partition=_partition_gated_grad,
                                           infer_sharding_from_operands=_infer_gated_grad,
                                           sharding_rule=_gated_grad_sharding_rule, num_static=2)


def partitioned_gated_ragged_grad(dy: jax.Array, wd: jax.Array, gs: jax.Array, pre: jax.Array, *,
                                  local_op: Callable, params: dict) -> list[jax.Array]:
    """``local_op(dy, wd, gs, pre, **params)`` (the gated gradient primitive's local product)
    under the partitioning rules above."""
    params = Params.static(params)
    return _partitioned_gated_grad(local_op, params, dy, wd, gs, pre)


# ---------------------------------------------------------------- the FP8 rows form
# Operands x [B, M, K], w [Bw, G, N, K], group sizes [Bg, G], sa [B, Kb, M] or [] and sb
# [Bw, G, Kb, Nb] or [] (fp8_ragged_dot's primitive); result [B, M, N]. The batch and M, the
# tokens (with local group sizes, as above; x's block scales split with x's rows), keep the
# operands' sharding; K, N and G are never split: each device holds every expert's whole weights
# and scales (a split K would cut the 128-deep scale blocks, a split N their 128-wide ones).


def _choose_fp8(mesh, arg_shapes, params):
    x, w, gs, sa, _ = arg_shapes
    x_spec, w_spec = spec_of(x.sharding, 3), spec_of(w.sharding, 4)
    sa_spec = spec_of(sa.sharding, 3) if params["sa_block"] else [()] * 3
    claim = AxisClaims(mesh)
    w_batched = w.shape[0] == x.shape[0] and w.shape[0] > 1
    b = claim(x_spec[0] or sa_spec[0] or (w_spec[0] if w_batched else ()), x.shape[0])
    m = claim(x_spec[1] or sa_spec[2], x.shape[1])
    wb = b if w_batched else ()
    gs_batched = gs.shape[0] == x.shape[0] and gs.shape[0] > 1
    return dict(m=m, x=(b, m, ()), w=(wb, (), (), ()), gs=(b if gs_batched else (), ()),
                sa=(b, (), m) if params["sa_block"] else (),
                sb=(wb, (), (), ()) if params["sb_block"] else (), out=(b, m, ()))


def _infer_fp8(local_op, params, mesh, arg_shapes, result_shape):
    del local_op, result_shape
    return NamedSharding(mesh, _spec(_choose_fp8(mesh, arg_shapes, params)["out"]))


def _partition_fp8(local_op, params, mesh, arg_shapes, result_shape):
    del result_shape
    choice = _choose_fp8(mesh, arg_shapes, params)
    keys = ("x", "w", "gs", "sa", "sb")
    sharded, local_sizes = _row_shards(mesh, choice, arg_shapes[0].shape[1], keys)
    local_params = dict(params, config=None) if sharded else dict(params)

    def per_device(x, w, gs, sa, sb):
        return local_op(x, w, local_sizes(gs), sa, sb, **local_params)

    arg_shardings = tuple(NamedSharding(mesh, _spec(choice[key])) for key in keys)
    return mesh, per_device, NamedSharding(mesh, _spec(choice["out"])), arg_shardings


def _fp8_sharding_rule(local_op, params, mesh, operand_types, result_types):
    """Factors b, m, k, n, g and the scales' kb, nb; only b and m are split. A batch dim of size
    1 (shared) gets its own factor; a one-value scale is a scalar."""
    del local_op, mesh, result_types
    x_t, w_t, gs_t = operand_types[:3]
    batch = x_t.shape[0]
    wb, gb = _batch_factors(batch, w_t, gs_t)
    sa = "b kb m" if params["sa_block"] else ""
    sb = f"{wb} g kb nb" if params["sb_block"] else ""
    rule = f"b m k, {wb} g n k, {gb} g, {sa}, {sb} -> b m n"
    # (in the order the factors first appear, as Shardy wants them)
    whole = ("k", "g", "n") + (("kb",) if sa or sb else ()) + (("nb",) if sb else ())
    return rule, dict(need_replication_factors=whole)


_partitioned_fp8 = partitioned_call(partition=_partition_fp8,
                                    infer_sharding_from_operands=_infer_fp8,
                                    sharding_rule=_fp8_sharding_rule, num_static=2)


def partitioned_fp8_ragged_dot(x: jax.Array, w: jax.Array, gs: jax.Array, sa: jax.Array,
                               sb: jax.Array, *, local_op: Callable, params: dict) -> jax.Array:
    """``local_op(x, w, gs, sa, sb, **params)`` (the FP8 primitive's local product) under the
    partitioning rules above."""
    params = Params.static(params)
    return _partitioned_fp8(local_op, params, x, w, gs, sa, sb)
