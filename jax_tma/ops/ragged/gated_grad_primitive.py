"""The gated gradient grouped primitive ``jax_tma_gated_ragged_grad`` behind
``jax_tma.gated_ragged_mlp``'s backward pass (gated_mlp.py): from the down projection's
cotangent dy and the gated product's saved pre-activations, the gate's and the up's cotangents

    dh = dy[rows of g] @ w_down[g]^T    (fp32, rounded to the operands' type, as unfused)
    d_gate = dh * up * act'(gate),  d_up = dh * act(gate)    (fp32, each rounded once)

over the rows of each group, zero for rows past the last group. It lowers to XLA everywhere and,
on CUDA, to the ``jax_tma_gated_ragged_grad_sm90`` kernel pair when every operand is bf16 or
fp16 of one type and the activation is silu or the tanh GELU (csrc/contract/sm90_ragged_dot.h,
the gated gradient rows mode): w_down is read transposed in place, and the product's epilogue
writes both cotangents. Batching folds vmapped axes into the kernel's batch; sharding keeps the
tokens' (batch, M) and F's, with D and the groups whole (sharding.py); its JVP (second-order
gradients of gated_ragged_mlp) differentiates the same expression on ragged_dot's primitive.

Operands dy [B, M, D], w_down [Bw, G, F, D], group sizes [Bg, G] (Bw, Bg: 1 or B), pre
[2, B, M, F] (gate, up). Results d_gate and d_up [B, M, F].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching

from jax_tma._core.aval import result_aval
from jax_tma._core.primitive import bind_local, define_primitive, kernel_ffi_call, planned_call
from jax_tma.ops.dense.primitive import ACTIVATIONS, activate, activation_grad
from jax_tma.ops.ragged import sharding as ragged_sharding
from jax_tma.ops.ragged.config import ROWS, clamp_sizes, default_gated_grad_config
from jax_tma.ops.ragged.primitive import _bind as _ragged_bind
from jax_tma.ops.ragged.primitive import _pad_axis
from jax_tma.ops.ragged.primitive import _reference as _ragged_reference
from jax_tma.ops.ragged.primitive import call_attrs, fold_vmapped, kernel_plan, workspace_bytes

KERNEL_TARGET = "jax_tma_gated_ragged_grad_sm90"
# sm90_gemm::kRaggedGatedGradMapsPerSegment: D's, the up cotangent's and two pre-activations'.
_MAPS_PER_SEGMENT = 4
# The activations whose gated gradient is compiled (tiles.RAGGED_GATED_GRAD_FUSIONS).
KERNEL_ACTIVATIONS = ("silu", "gelu_tanh")


def gated_grad_workspace_bytes(groups: int, batch: int) -> int:
    """Bytes of the kernel's workspace (ragged_workspace_bytes, four maps a segment)."""
    return workspace_bytes(ROWS, groups, batch, _MAPS_PER_SEGMENT)


def _abstract_eval(dy, wd, gs, pre, *, activation, out_dtype, config, local):
    del activation, config, local
    shape = (dy.shape[0], dy.shape[1], wd.shape[2])
    return [result_aval(shape, out_dtype, dy, wd, gs, pre)] * 2


def _rows_within(gs, rows: int):
    """[B or 1, M, 1]: whether each row lies in a group (sizes clamped to [0, M], the running sum
    to M, as the kernels read them)."""
    sizes = clamp_sizes(gs, rows).astype(jnp.uint32)
    # Saturating at rows (below 2^31): two terms add without wrapping.
    total = lax.associative_scan(lambda a, b: jnp.minimum(a + b, rows), sizes,
                                 axis=-1)[:, -1].astype(jnp.int32)
    return (jnp.arange(rows)[None, :] < total[:, None])[..., None]


def _cotangents(dh, gs, pre, activation, out_dtype):
    """(d_gate, d_up) from dh [B, M, F] in fp32: dh rounded to ``out_dtype``, the cotangents in
    fp32, each rounded once; rows past the last group zero."""
    dh = dh.astype(out_dtype).astype(jnp.float32)
    gate, up = pre[0].astype(jnp.float32), pre[1].astype(jnp.float32)
    inside = _rows_within(gs, dh.shape[1])
    d_gate = jnp.where(inside, dh * up * activation_grad(activation, gate), 0)
    d_up = jnp.where(inside, dh * activate(activation, gate), 0)
    return [d_gate.astype(out_dtype), d_up.astype(out_dtype)]


def _reference(dy, wd, gs, pre, *, activation, out_dtype, config, local):
    """What the kernel computes, in XLA."""
    del config, local
    dh = _ragged_reference(dy, wd, gs, mode=ROWS, w_k_major=True, out_dtype=jnp.float32,
                           config=None, local=False)
    return _cotangents(dh, gs, pre, activation, out_dtype)


def gated_grad_kernel_plan(dy, wd, gs, pre, activation, out_dtype):
    """The kernel's view of the call (ragged_dot's rows-form plan, w_down K-major), or None when
    it runs through XLA: operands or outputs not of one 16-bit type, an activation without a
    compiled gradient, an empty product, or sizes past the kernel's int32 numbering."""
    dtype = jnp.dtype(dy.dtype)
    if activation not in KERNEL_ACTIVATIONS or jnp.dtype(out_dtype) != dtype or any(
            jnp.dtype(v.dtype) != dtype for v in (wd, pre)):
        return None
    return kernel_plan(dy, wd, gs, ROWS, True, out_dtype)


def _kernel_call(dy, wd, gs, pre, *, activation, out_dtype, config, plan,
                 poison: bool = False):
    """The FFI call: D and F padded with zeros to multiples of 8 where needed (padded columns
    are cut off), group sizes as int32 clamped to [0, M]. With `poison` the kernel writes over
    NaN-filled results (tests)."""
    out_dtype = jnp.dtype(out_dtype)
    dy = _pad_axis(dy, 2, plan.k_pad)
    wd = _pad_axis(_pad_axis(wd, 3, plan.k_pad), 2, plan.n_pad)
    pre = _pad_axis(pre, 3, plan.n_pad)
    kp, fp = plan.k + plan.k_pad, plan.n + plan.n_pad
    gs = clamp_sizes(gs, plan.rows)
    cfg = config if config is not None else default_gated_grad_config(
        plan.batch * plan.rows, fp, kp, plan.groups * plan.batch)
    attrs = dict(call_attrs(cfg, plan, fp, kp, wd.shape[0] > 1, gs),
                 activation=np.int64(ACTIVATIONS[activation]))
    shape = jax.ShapeDtypeStruct((plan.batch, plan.rows, fp), out_dtype)
    out_types = (shape, shape,
                 jax.ShapeDtypeStruct((gated_grad_workspace_bytes(plan.groups, plan.batch),),
                                      jnp.uint8))
    d_gate, d_up, _ = kernel_ffi_call(KERNEL_TARGET, out_types, (dy, wd, gs, pre), attrs,
                                      poison=poison, poisoned=(0, 1))
    return [d_gate[..., :plan.n], d_up[..., :plan.n]]


def _kernel_fn(avals_in, params):
    plan = gated_grad_kernel_plan(*avals_in, params["activation"], params["out_dtype"])
    return planned_call(_kernel_call, plan, params)


def _partitioned(params):
    return functools.partial(ragged_sharding.partitioned_gated_ragged_grad,
                             local_op=bind_local(gated_ragged_grad_p), params=params)


def bind(dy, wd, gs, pre, *, activation: str, out_dtype, config=None, local: bool = False):
    """The primitive on dy [B, M, D], w_down [Bw, G, F, D], group sizes [Bg, G], pre
    [2, B, M, F]."""
    return gated_ragged_grad_p.bind(dy, wd, gs, pre, activation=activation,
                                    out_dtype=jnp.dtype(out_dtype), config=config, local=local)


def _batch_rule(args, dims, *, activation, out_dtype, config, local):
    """vmap: the mapped axis joins the batch (dy [V*B, M, D], pre [2, V*B, M, F]); shared
    weights and group sizes stay shared."""
    del config
    dy, wd, gs, pre = args
    dims = list(dims)
    if all(d is None for d in dims[:3]):  # only pre mapped: dy mapped alike (broadcast)
        dy = jnp.broadcast_to(dy[None], (pre.shape[dims[3]], *dy.shape))
        dims[0] = 0
    folded, size, batch = fold_vmapped((dy, wd, gs), dims[:3], (False, True, True))
    if dims[3] is None:
        pre = jnp.broadcast_to(pre[:, None], (2, size, *pre.shape[1:]))
    else:
        pre = jnp.moveaxis(pre, dims[3], 1)
    if pre.shape[2] != batch:  # shared along the old batch: repeat it per entry
        pre = jnp.broadcast_to(pre, (2, size, batch, *pre.shape[3:]))
    pre = pre.reshape(2, size * batch, *pre.shape[3:])
    outs = bind(*folded, pre, activation=activation, out_dtype=out_dtype, local=local)
    return [o.reshape(size, batch, *o.shape[1:]) for o in outs], [0, 0]


def _jvp(primals, tangents, *, activation, out_dtype, config, local):
    """The JVP of the cotangents as ragged_dot's primitive and jnp compute them (whose rules
    transpose them to any order: the second-order gradients of gated_ragged_mlp)."""
    dy, wd, gs, pre = primals
    tangents = [jnp.zeros_like(p) if type(t) is ad.Zero else t
                for p, t in zip((dy, wd, pre), (tangents[0], tangents[1], tangents[3]))]
    outs = gated_ragged_grad_p.bind(*primals, activation=activation, out_dtype=out_dtype,
                                    config=config, local=local)

    def composed(dy, wd, pre):
        dh = _ragged_bind(dy, wd, gs, ROWS, True, jnp.float32, local)
        return _cotangents(dh, gs, pre, activation, out_dtype)

    _, tangent_outs = jax.jvp(composed, (dy, wd, pre), tuple(tangents))
    return outs, tangent_outs


gated_ragged_grad_p = define_primitive("jax_tma_gated_ragged_grad",
                                       abstract_eval=_abstract_eval, reference=_reference,
                                       kernel_fn=_kernel_fn, partitioned=_partitioned,
                                       multiple_results=True)
ad.primitive_jvps[gated_ragged_grad_p] = _jvp
batching.primitive_batchers[gated_ragged_grad_p] = _batch_rule
