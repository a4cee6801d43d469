// TMA tensor-map encoding; see tensor_map.h.
#include "ffi/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>

namespace jax_tma::ffi_util {
namespace {

// cuTensorMapEncodeTiled from the driver, looked up once through the versioned entry point
// (the unversioned lookup is gone in CUDA 13). The function pointer does not depend on the
// device or on any address, so one lookup serves every call.
PFN_cuTensorMapEncodeTiled_v12000 encode_fn(std::string* error) {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::string lookup_error;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                       cudaEnableDefault, &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || ptr == nullptr) {
      lookup_error = std::string("cuTensorMapEncodeTiled is not available from the driver (") +
                     cudaGetErrorString(err) + ")";
      return;
    }
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  });
  if (fn == nullptr) *error = lookup_error;
  return fn;
}

CUtensorMapSwizzle to_cu(Swizzle s) {
  switch (s) {
    case Swizzle::k32B: return CU_TENSOR_MAP_SWIZZLE_32B;
    case Swizzle::k64B: return CU_TENSOR_MAP_SWIZZLE_64B;
    case Swizzle::k128B: return CU_TENSOR_MAP_SWIZZLE_128B;
    case Swizzle::kNone: break;
  }
  return CU_TENSOR_MAP_SWIZZLE_NONE;
}

}  // namespace

int tensor_map_element_bytes(CUtensorMapDataType dtype) {
  switch (dtype) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32: return 4;
    default: return 0;
  }
}

std::string validate_tensor_map(const void* base, const TensorMapSpec& spec) {
  using std::to_string;
  const int elem = tensor_map_element_bytes(spec.dtype);
  if (elem == 0) return "tensor map: unsupported element type";
  if (spec.rank < 1 || spec.rank > 5) {
    return "tensor map: rank " + to_string(spec.rank) + " is outside 1..5";
  }
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    return "tensor map: base address " + to_string(reinterpret_cast<uintptr_t>(base)) +
           " is not 16-byte aligned";
  }
  for (int i = 0; i < spec.rank; ++i) {
    if (spec.dims[i] == 0 || spec.dims[i] > (uint64_t{1} << 32)) {
      return "tensor map: dimension " + to_string(i) + " has size " + to_string(spec.dims[i]) +
             " (must be 1..2^32)";
    }
    if (spec.box[i] == 0 || spec.box[i] > 256) {
      return "tensor map: box dimension " + to_string(i) + " is " + to_string(spec.box[i]) +
             " (must be 1..256)";
    }
  }
  for (int i = 0; i + 1 < spec.rank; ++i) {
    const uint64_t stride = spec.byte_strides[i];
    if (stride % 16 != 0 || stride == 0 || stride >= (uint64_t{1} << 40)) {
      return "tensor map: stride of dimension " + to_string(i + 1) + " is " + to_string(stride) +
             " bytes (must be a positive multiple of 16 below 2^40)";
    }
  }
  const uint64_t inner_box_bytes = uint64_t{spec.box[0]} * elem;
  if (inner_box_bytes % 16 != 0) {
    return "tensor map: inner box of " + to_string(spec.box[0]) + " elements is " +
           to_string(inner_box_bytes) + " bytes (must be a multiple of 16)";
  }
  const auto span = static_cast<uint64_t>(static_cast<int>(spec.swizzle));
  if (spec.swizzle != Swizzle::kNone && inner_box_bytes > span) {
    return "tensor map: inner box of " + to_string(inner_box_bytes) + " bytes exceeds the " +
           to_string(span) + "-byte swizzle span";
  }
  return {};
}

std::string encode_tensor_map(CUtensorMap* map, void* base, const TensorMapSpec& spec) {
  std::string error = validate_tensor_map(base, spec);
  if (!error.empty()) return error;
  auto fn = encode_fn(&error);
  if (fn == nullptr) return error;
  cuuint64_t dims[5];
  cuuint64_t strides[5];
  cuuint32_t box[5];
  cuuint32_t element_strides[5];
  for (int i = 0; i < spec.rank; ++i) {
    dims[i] = spec.dims[i];
    box[i] = spec.box[i];
    element_strides[i] = 1;
    strides[i] = spec.byte_strides[i];
  }
  CUresult res = fn(map, spec.dtype, static_cast<cuuint32_t>(spec.rank), base, dims, strides, box,
                    element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, to_cu(spec.swizzle),
                    spec.l2_promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    return "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(res));
  }
  return {};
}

TensorMapSpec make_2d_spec(CUtensorMapDataType dtype, uint64_t rows, uint64_t cols,
                           uint64_t row_stride_elems, uint32_t box_rows, uint32_t box_cols,
                           Swizzle swizzle) {
  TensorMapSpec spec;
  spec.dtype = dtype;
  spec.rank = 2;
  spec.dims = {cols, rows, 0, 0, 0};
  spec.byte_strides = {row_stride_elems * tensor_map_element_bytes(dtype), 0, 0, 0, 0};
  spec.box = {box_cols, box_rows, 0, 0, 0};
  spec.swizzle = swizzle;
  return spec;
}

}  // namespace jax_tma::ffi_util
