// XLA FFI handlers of the grouped (ragged) products (platform CUDA); the operands, attributes
// and checks are described in ragged_dot.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_handlers {

// jax_tma_ragged_dot_sm90: (x, w or dy, group_sizes) -> (out, workspace).
XLA_FFI_DECLARE_HANDLER_SYMBOL(RaggedDotSm90);
// jax_tma_ragged_dot_sm90_into: (x, w or dy, group_sizes, out_in) -> out aliased to out_in
// (tests poison out_in).
XLA_FFI_DECLARE_HANDLER_SYMBOL(RaggedDotSm90Into);
// jax_tma_gated_ragged_dot_sm90: (x, w_gate, w_up, group_sizes) -> (out, pre, workspace).
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatedRaggedDotSm90);
// jax_tma_gated_ragged_dot_sm90_into: (x, w_gate, w_up, group_sizes, out_in, pre_in) -> out and
// pre aliased to out_in and pre_in (tests poison them).
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatedRaggedDotSm90Into);
// jax_tma_gated_ragged_grad_sm90: (dy, w_down, group_sizes, pre) -> (d_gate, d_up, workspace).
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatedRaggedGradSm90);
// jax_tma_gated_ragged_grad_sm90_into: (dy, w_down, group_sizes, pre, d_gate_in, d_up_in) ->
// d_gate and d_up aliased to d_gate_in and d_up_in (tests poison them).
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatedRaggedGradSm90Into);
// jax_tma_fp8_ragged_dot_sm90: (x, w, group_sizes, sa, sb, row_scale, col_scale) ->
// (out, workspace).
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8RaggedDotSm90);
// jax_tma_fp8_ragged_dot_sm90_into: (x, w, group_sizes, sa, sb, row_scale, col_scale, out_in) ->
// out aliased to out_in (tests poison out_in).
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8RaggedDotSm90Into);

}  // namespace jax_tma::ffi_handlers
