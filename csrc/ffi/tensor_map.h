// Host-side encoding of TMA tensor maps (CUtensorMap) for tiled bulk copies.
//
// A TensorMapSpec describes a strided tensor in global memory (dimensions innermost first, in
// elements; strides of dimensions 1.. in bytes) and the box one copy moves. encode_tensor_map
// checks every hardware limit first and returns a message naming the offending value, so a bad
// map is a clear error on the host instead of a failed launch. Tensor maps embed the base
// address: encode them for every call.
#pragma once

#include <cuda.h>

#include <array>
#include <cstdint>
#include <string>

namespace jax_tma::ffi_util {

enum class Swizzle : int { kNone = 0, k32B = 32, k64B = 64, k128B = 128 };

struct TensorMapSpec {
  CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  int rank = 2;
  std::array<uint64_t, 5> dims{};          // elements, innermost first
  std::array<uint64_t, 5> byte_strides{};  // byte_strides[i]: step of dimension i + 1
  std::array<uint32_t, 5> box{};           // elements per copy, innermost first
  Swizzle swizzle = Swizzle::kNone;
  CUtensorMapL2promotion l2_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
};

// Bytes of one element of `dtype`, or 0 for a type this encoder does not handle.
int tensor_map_element_bytes(CUtensorMapDataType dtype);

// Checks `spec` against the TMA limits; returns an empty string when it is valid.
std::string validate_tensor_map(const void* base, const TensorMapSpec& spec);

// Validates and encodes; returns an empty string on success, otherwise what is wrong.
// Out-of-bounds elements of a box read as zero.
std::string encode_tensor_map(CUtensorMap* map, void* base, const TensorMapSpec& spec);

// Row-major 2-D tensor rows x cols with a row pitch of `row_stride_elems`, box rows x cols.
TensorMapSpec make_2d_spec(CUtensorMapDataType dtype, uint64_t rows, uint64_t cols,
                           uint64_t row_stride_elems, uint32_t box_rows, uint32_t box_cols,
                           Swizzle swizzle);

}  // namespace jax_tma::ffi_util
