// FFI handlers that run the primitive test kernels of csrc/testing/ on contiguous row-major
// buffers. Tensor maps are encoded here with the same encoder the ops use, so its host-side
// validation errors surface to the tests unchanged.
#include "ffi/testing.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "ffi/cuda_check.h"
#include "ffi/tensor_map.h"
#include "testing/primitives_test.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {
namespace {

using testing::MulticastArgs;
using testing::PhaseArgs;
using testing::ReduceAddArgs;
using testing::RoundTripArgs;

bool tma_type(ffi::DataType t, CUtensorMapDataType* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16; return true;
    case ffi::DataType::F16: *out = CU_TENSOR_MAP_DATA_TYPE_FLOAT16; return true;
    case ffi::DataType::F32: *out = CU_TENSOR_MAP_DATA_TYPE_FLOAT32; return true;
    case ffi::DataType::S32: *out = CU_TENSOR_MAP_DATA_TYPE_INT32; return true;
    case ffi::DataType::S8:
    case ffi::DataType::U8:
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E5M2: *out = CU_TENSOR_MAP_DATA_TYPE_UINT8; return true;
    default: return false;
  }
}

bool to_swizzle(int64_t bytes, ffi_util::Swizzle* out) {
  switch (bytes) {
    case 0: *out = ffi_util::Swizzle::kNone; return true;
    case 32: *out = ffi_util::Swizzle::k32B; return true;
    case 64: *out = ffi_util::Swizzle::k64B; return true;
    case 128: *out = ffi_util::Swizzle::k128B; return true;
  }
  return false;
}

// Spec of a contiguous row-major buffer with the given box (outermost first, as in Python).
ffi::Error contiguous_spec(const ffi::AnyBuffer& x, ffi::Span<const int64_t> box, int64_t swizzle,
                           ffi_util::TensorMapSpec* spec) {
  const auto dims = x.dimensions();
  const int rank = static_cast<int>(dims.size());
  if (!tma_type(x.element_type(), &spec->dtype)) {
    return ffi::Error::InvalidArgument("tensor map: unsupported element type");
  }
  if (static_cast<int>(box.size()) != rank) {
    return ffi::Error::InvalidArgument("tensor map: box rank " + std::to_string(box.size()) +
                                       " differs from the tensor's rank " + std::to_string(rank));
  }
  if (rank < 1 || rank > 5) {
    return ffi::Error::InvalidArgument("tensor map: rank " + std::to_string(rank) +
                                       " is outside 1..5");
  }
  if (!to_swizzle(swizzle, &spec->swizzle)) {
    return ffi::Error::InvalidArgument("tensor map: swizzle must be 0, 32, 64 or 128 bytes, got " +
                                       std::to_string(swizzle));
  }
  spec->rank = rank;
  uint64_t stride = ffi_util::tensor_map_element_bytes(spec->dtype);
  for (int i = 0; i < rank; ++i) {
    const int src = rank - 1 - i;  // innermost first
    spec->dims[i] = static_cast<uint64_t>(dims[src]);
    spec->box[i] = static_cast<uint32_t>(box[src]);
    stride *= static_cast<uint64_t>(dims[src]);
    if (i + 1 < rank) spec->byte_strides[i] = stride;
  }
  return ffi::Error::Success();
}

ffi::Error encode(CUtensorMap* map, void* base, const ffi_util::TensorMapSpec& spec) {
  const std::string err = ffi_util::encode_tensor_map(map, base, spec);
  return err.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(err);
}

uint32_t box_bytes_of(const ffi_util::TensorMapSpec& spec) {
  uint64_t bytes = ffi_util::tensor_map_element_bytes(spec.dtype);
  for (int i = 0; i < spec.rank; ++i) bytes *= spec.box[i];
  return static_cast<uint32_t>(bytes);
}

void box_counts_of(const ffi_util::TensorMapSpec& spec, int* counts, int* box) {
  for (int i = 0; i < spec.rank; ++i) {
    box[i] = static_cast<int>(spec.box[i]);
    counts[i] = static_cast<int>((spec.dims[i] + spec.box[i] - 1) / spec.box[i]);
  }
}

constexpr uint32_t kMaxTestBoxBytes = 200 * 1024;

ffi::Error tma_round_trip(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> images, ffi::Result<ffi::AnyBuffer> timeouts,
                          ffi::Span<const int64_t> box, int64_t swizzle, int64_t timeout_cycles) {
  ffi_util::TensorMapSpec spec;
  if (auto err = contiguous_spec(x, box, swizzle, &spec); err.failure()) return err;
  RoundTripArgs args{};
  CUtensorMap map_in, map_out;
  if (auto err = encode(&map_in, x.untyped_data(), spec); err.failure()) return err;
  if (auto err = encode(&map_out, y->untyped_data(), spec); err.failure()) return err;
  args.map_in = &map_in;
  args.map_out = &map_out;
  args.rank = spec.rank;
  box_counts_of(spec, args.box_counts, args.box);
  args.box_bytes = box_bytes_of(spec);
  if (args.box_bytes > kMaxTestBoxBytes) {
    return ffi::Error::InvalidArgument("test box exceeds the shared memory of one CTA");
  }
  int64_t boxes = 1;
  for (int i = 0; i < spec.rank; ++i) boxes *= args.box_counts[i];
  if (images->size_bytes() != static_cast<size_t>(boxes) * args.box_bytes) {
    return ffi::Error::InvalidArgument("images must hold " + std::to_string(boxes) + " boxes of " +
                                       std::to_string(args.box_bytes) + " bytes");
  }
  args.images = static_cast<uint8_t*>(images->untyped_data());
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  if (auto err = ffi_util::cuda_error(cudaMemsetAsync(args.timeouts, 0, 4, stream), "memset");
      err.failure()) {
    return err;
  }
  return ffi_util::cuda_error(testing::launch_tma_round_trip(args, stream), "tma round trip launch");
}

ffi::Error tma_reduce_add(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer /*y_in*/,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> timeouts,
                          ffi::Span<const int64_t> box, int64_t timeout_cycles) {
  ffi_util::TensorMapSpec spec;
  if (x.dimensions().size() != 2) return ffi::Error::InvalidArgument("reduce-add test is 2-D");
  if (auto err = contiguous_spec(x, box, 0, &spec); err.failure()) return err;
  CUtensorMap map_x, map_y;
  if (auto err = encode(&map_x, x.untyped_data(), spec); err.failure()) return err;
  if (auto err = encode(&map_y, y->untyped_data(), spec); err.failure()) return err;
  ReduceAddArgs args{};
  args.map_x = &map_x;
  args.map_y = &map_y;
  box_counts_of(spec, args.box_counts, args.box);
  args.box_bytes = box_bytes_of(spec);
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  if (auto err = ffi_util::cuda_error(cudaMemsetAsync(args.timeouts, 0, 4, stream), "memset");
      err.failure()) {
    return err;
  }
  return ffi_util::cuda_error(testing::launch_tma_reduce_add(args, stream), "tma reduce-add launch");
}

ffi::Error tma_multicast(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> images,
                         ffi::Result<ffi::AnyBuffer> timeouts, int64_t cluster_m,
                         int64_t cluster_n, int64_t issuers, int64_t mask, int64_t mode,
                         int64_t extra_tx_bytes, int64_t timeout_cycles) {
  const int64_t size = cluster_m * cluster_n;
  const auto dims = x.dimensions();
  if (size < 1 || size > 8 || dims.size() != 2 || dims[0] % size != 0) {
    return ffi::Error::InvalidArgument("multicast test: x must be [cluster_size * rows, cols]");
  }
  ffi_util::TensorMapSpec spec;
  const int64_t box[2] = {dims[0] / size, dims[1]};
  if (auto err = contiguous_spec(x, ffi::Span<const int64_t>(box, 2), 0, &spec); err.failure()) {
    return err;
  }
  CUtensorMap map_x;
  if (auto err = encode(&map_x, x.untyped_data(), spec); err.failure()) return err;
  MulticastArgs args{};
  args.map_x = &map_x;
  args.cluster_m = static_cast<int>(cluster_m);
  args.cluster_n = static_cast<int>(cluster_n);
  args.issuers = static_cast<uint32_t>(issuers);
  args.mask = static_cast<uint32_t>(mask);
  args.mode = static_cast<int>(mode);
  args.extra_tx_bytes = static_cast<uint32_t>(extra_tx_bytes);
  args.box_rows = static_cast<int>(box[0]);
  args.box_bytes = box_bytes_of(spec);
  if (args.box_bytes % 128 != 0 || images->size_bytes() != size * size * args.box_bytes) {
    return ffi::Error::InvalidArgument("multicast test: box bytes must be a multiple of 128 and "
                                       "images [size, size, box_bytes]");
  }
  args.images = static_cast<uint8_t*>(images->untyped_data());
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  if (auto err = ffi_util::cuda_error(cudaMemsetAsync(args.timeouts, 0, 4 * size, stream), "memset");
      err.failure()) {
    return err;
  }
  return ffi_util::cuda_error(testing::launch_tma_multicast(args, stream), "tma multicast launch");
}

ffi::Error pipeline_phases(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> seen,
                           ffi::Result<ffi::AnyBuffer> timeouts, int64_t stages,
                           int64_t timeout_cycles) {
  const auto dims = seen->dimensions();
  if (dims.size() != 2 || dims[0] < 1 || dims[0] > 31) {
    return ffi::Error::InvalidArgument("phase test: seen must be [consumers (1..31), iterations]");
  }
  PhaseArgs args{};
  args.stages = static_cast<int>(stages);
  args.consumers = static_cast<int>(dims[0]);
  args.iterations = static_cast<int>(dims[1]);
  args.seen = static_cast<int32_t*>(seen->untyped_data());
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  if (auto err = ffi_util::cuda_error(cudaMemsetAsync(args.timeouts, 0, 4, stream), "memset");
      err.failure()) {
    return err;
  }
  return ffi_util::cuda_error(testing::launch_pipeline_phases(args, stream), "pipeline phase launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestTmaRoundTrip, tma_round_trip,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // x
                                  .Ret<ffi::AnyBuffer>()                      // y = x
                                  .Ret<ffi::AnyBuffer>()                      // images u8
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<ffi::Span<const int64_t>>("box")      // outermost first
                                  .Attr<int64_t>("swizzle")                   // bytes, 0 = none
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestTmaReduceAdd, tma_reduce_add,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // x
                                  .Arg<ffi::AnyBuffer>()                      // y_in
                                  .Ret<ffi::AnyBuffer>()                      // y = y_in + x
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<ffi::Span<const int64_t>>("box")      // outermost first
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestTmaMulticast, tma_multicast,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // x
                                  .Ret<ffi::AnyBuffer>()                      // images u8
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32
                                  .Attr<int64_t>("cluster_m")
                                  .Attr<int64_t>("cluster_n")
                                  .Attr<int64_t>("issuers")                   // CTA bitmask
                                  .Attr<int64_t>("mask")                      // mode 0 mask
                                  .Attr<int64_t>("mode")                      // 0 / same n / same m
                                  .Attr<int64_t>("extra_tx_bytes")
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestPipelinePhases, pipeline_phases,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ret<ffi::AnyBuffer>()                      // seen s32
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("timeout_cycles"));

}  // namespace jax_tma::ffi_handlers
