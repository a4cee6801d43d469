// Host helpers of the GEMM handlers; see gemm_maps.h.
#include "ffi/gemm_maps.h"

namespace jax_tma::ffi_util {

using sm90_gemm::DType;

bool to_dtype(xla::ffi::DataType t, DType* out) {
  switch (t) {
    case xla::ffi::DataType::BF16: *out = DType::kBF16; return true;
    case xla::ffi::DataType::F16: *out = DType::kF16; return true;
    case xla::ffi::DataType::F32: *out = DType::kF32; return true;
    default: return false;
  }
}

bool to_fp8_dtype(xla::ffi::DataType t, DType* out) {
  switch (t) {
    case xla::ffi::DataType::F8E4M3FN: *out = DType::kF8E4M3; return true;
    case xla::ffi::DataType::F8E5M2: *out = DType::kF8E5M2; return true;
    default: return false;
  }
}

CUtensorMapDataType tma_type(DType t) {
  switch (t) {
    case DType::kBF16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kF16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kF32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    case DType::kF8E4M3:
    case DType::kF8E5M2: return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // TMA moves bytes
  }
  return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

sm90_gemm::GemmShape problem_shape(int64_t m, int64_t n, int64_t k, int64_t batch,
                                   int64_t splits, int64_t per_split, bool a_batched,
                                   bool b_batched) {
  sm90_gemm::GemmShape shape{};
  shape.m = static_cast<int>(m);
  shape.n = static_cast<int>(n);
  shape.k = static_cast<int>(k);
  shape.batch = static_cast<int>(batch);
  shape.splits = static_cast<int>(splits);
  shape.k_blocks_per_split = static_cast<int>(per_split);
  shape.a_batched = a_batched;
  shape.b_batched = b_batched;
  shape.d_m_stride = n;
  shape.d_batch_stride = m * n;
  shape.d_split_stride = batch * m * n;
  return shape;
}

int64_t last_offset(std::initializer_list<ViewDim> dims) {
  unsigned __int128 end = 0;
  for (const ViewDim& d : dims) {
    end += static_cast<unsigned __int128>(d.extent - 1) * static_cast<uint64_t>(d.stride);
  }
  return end > INT64_MAX ? -1 : static_cast<int64_t>(end);
}

std::string check_in_bounds(const char* operand, std::initializer_list<ViewDim> dims,
                            size_t elements, const std::string& context) {
  const int64_t last = last_offset(dims);
  if (last >= 0 && static_cast<uint64_t>(last) < elements) return {};
  std::string strides;
  for (const ViewDim& v : dims) strides += std::string(", ") + v.name + "=" + str(v.stride);
  return std::string(operand) + " addresses element " +
         (last < 0 ? std::string("past 2^63") : str(last)) + " but its buffer holds " +
         std::to_string(elements) + " (" + context + strides + ")";
}

std::string check_tma_strides(const char* operand, std::initializer_list<ViewDim> dims,
                              int64_t bytes) {
  for (const ViewDim& d : dims) {
    if (d.extent > 1 && (d.stride * bytes) % 16 != 0) {
      return std::string(operand) + " is read or written by TMA, which needs 16-byte strides, " +
             "but " + d.name + "=" + str(d.stride) + " elements is " + str(d.stride * bytes) +
             " bytes";
    }
  }
  return {};
}

// NOTE: cuTensorMapEncodeTiled's documentation illustrates the strides with a padded layout
// whose strides grow outwards, but states as requirements only that each be a multiple of 16
// below 2^40. CUTLASS's TMA builder passes strides in the order of the box's modes, unsorted,
// and FlashAttention-3 relies on that for BSHD tensors (map {D, S, H, B}: the H stride is
// below the S stride). So each map keeps its logical dimension order, {contiguous, other,
// batch[, split]}, whatever the order of the strides, and the kernel's coordinates never
// depend on them. Should a driver reject an order, encoding fails and the call returns
// InvalidArgument naming the map, never a wrong result.
//
// A dimension of extent 1 only ever sees coordinate 0 in bounds, so its stride is free: it
// gets the dense one (previous stride x previous extent, rounded up to 16 bytes), which also
// satisfies that documented form. A broadcast operand's batch dimension is such a dimension.
TensorMapSpec strided_spec(DType dtype, std::initializer_list<ViewDim> dims, const int* box) {
  const uint64_t bytes = sm90_gemm::dtype_bytes(dtype);
  TensorMapSpec spec;
  spec.dtype = tma_type(dtype);
  spec.rank = static_cast<int>(dims.size());
  spec.swizzle = Swizzle::k128B;
  uint64_t prev_bytes = bytes;
  uint64_t prev_extent = 1;
  int i = 0;
  for (const ViewDim& d : dims) {
    spec.dims[i] = static_cast<uint64_t>(d.extent);
    spec.box[i] = static_cast<uint32_t>(box[i]);
    if (i > 0) {
      const uint64_t dense = (prev_bytes * prev_extent + 15) / 16 * 16;
      spec.byte_strides[i - 1] = d.extent > 1 ? static_cast<uint64_t>(d.stride) * bytes : dense;
      prev_bytes = spec.byte_strides[i - 1];
    }
    prev_extent = static_cast<uint64_t>(d.extent);
    ++i;
  }
  return spec;
}

TensorMapSpec block_scale_spec(ViewDim inner, ViewDim slices, ViewDim batch, int box_inner) {
  const int box[3] = {box_inner, 1, 1};
  TensorMapSpec spec = strided_spec(DType::kF32, {inner, slices, batch}, box);
  spec.swizzle = Swizzle::kNone;
  return spec;
}

TensorMapSpec output_spec(DType dtype, ViewDim n, ViewDim m, ViewDim batch, ViewDim split,
                          int chunk_row_bytes, int chunk_rows) {
  const int box[4] = {chunk_row_bytes / sm90_gemm::dtype_bytes(dtype), chunk_rows, 1, 1};
  return strided_spec(dtype, {n, m, batch, split}, box);
}

}  // namespace jax_tma::ffi_util
