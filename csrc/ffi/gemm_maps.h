// Host helpers shared by the GEMM handlers (ffi/gemm.cc, ffi/ragged_dot.cc): element types,
// strided views of flat buffers, their bounds and TMA stride checks, and the tensor maps of the
// sm90 kernel's operands. Every check returns a message naming the offending value instead of
// failing a launch.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "ffi/tensor_map.h"
#include "contract/sm90_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_util {

inline std::string str(int64_t v) { return std::to_string(v); }

// The kernel's element type of an XLA type; false for a type the kernels do not take. FP8
// types are not mapped here (to_fp8_dtype: only the FP8 handlers take them).
bool to_dtype(xla::ffi::DataType t, sm90_gemm::DType* out);
// The FP8 operand type (e4m3 or e5m2) of an XLA type; false for any other.
bool to_fp8_dtype(xla::ffi::DataType t, sm90_gemm::DType* out);
CUtensorMapDataType tma_type(sm90_gemm::DType t);

// One dimension of a strided view: how many indices, the element stride, the attribute name.
struct ViewDim {
  int64_t extent, stride;
  const char* name;
};

// Largest element offset a view addresses, or -1 past INT64_MAX.
int64_t last_offset(std::initializer_list<ViewDim> dims);

// "" when the view's last element lies inside a buffer of `elements`, else a message naming
// the operand, the view and `context` (the call's sizes).
std::string check_in_bounds(const char* operand, std::initializer_list<ViewDim> dims,
                            size_t elements, const std::string& context);

// "" when every dimension with more than one index has a stride that is a multiple of 16
// bytes (TMA reads or writes it), else which one is not.
std::string check_tma_strides(const char* operand, std::initializer_list<ViewDim> dims,
                              int64_t bytes);

// A 128-byte-swizzled map of a strided view, dimensions in the order given (innermost first),
// with the box `box`. See gemm_maps.cc for the strides of dimensions of extent 1.
TensorMapSpec strided_spec(sm90_gemm::DType dtype, std::initializer_list<ViewDim> dims,
                           const int* box);

// A or B of the sm90 kernel: rank 3, {contiguous, other, batch}; `mn` is M for A, N for B.
template <sm90_gemm::Major kMajor>
TensorMapSpec operand_spec(sm90_gemm::DType dtype, ViewDim mn, ViewDim k, ViewDim batch,
                           const int (&box)[3]) {
  const auto d = sm90_gemm::inner_outer<kMajor>(mn, k);
  return strided_spec(dtype, {d.inner, d.outer, batch}, box);
}

// The launch's problem: `batch` products of m x n x k in `splits` K ranges of `per_split` blocks
// each, D contiguous ([splits, batch, m, n]); a handler with other D strides sets them after.
sm90_gemm::GemmShape problem_shape(int64_t m, int64_t n, int64_t k, int64_t batch,
                                   int64_t splits, int64_t per_split, bool a_batched = false,
                                   bool b_batched = false);

// Block scales of an FP8 operand (mainloop/sm90_tma_wgmma_fp8.cuh): fp32, unswizzled, rank 3
// {inner, K slice, batch}, in boxes of {box_inner, 1, 1}: A's {rows, K / 128, batch} (a tile's
// rows), B's {N / 128, K / 128, batch} (one aligned box of column blocks).
TensorMapSpec block_scale_spec(ViewDim inner, ViewDim slices, ViewDim batch, int box_inner);

// D of the sm90 kernel's TMA-store epilogue: rank 4, {N, M, batch, split}, in boxes of one
// epilogue chunk (64 rows x 128 bytes).
TensorMapSpec output_spec(sm90_gemm::DType dtype, ViewDim n, ViewDim m, ViewDim batch,
                          ViewDim split, int chunk_row_bytes, int chunk_rows);

}  // namespace jax_tma::ffi_util
