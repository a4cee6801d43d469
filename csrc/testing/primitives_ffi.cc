// FFI handlers that run the primitive test kernels of csrc/testing/ on contiguous row-major
// buffers. Tensor maps are encoded here with the same encoder the ops use, so its host-side
// validation errors surface to the tests unchanged.
#include "testing/primitives_ffi.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>

#include "ffi/cuda_check.h"
#include "ffi/tensor_map.h"
#include "testing/primitives_test.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {
namespace {

using testing::MulticastArgs;
using testing::PairMathArgs;
using testing::PhaseArgs;
using testing::ReduceAddArgs;
using testing::CpAsyncPipelineArgs;
using testing::DsmemRingArgs;
using testing::NamedBarrierArgs;
using testing::OrderedBarrierArgs;
using testing::RoundTripArgs;
using testing::TensormapReplaceArgs;
using testing::TmaMulticastPipelineArgs;
using testing::TmaStorePipelineArgs;

// The common tail of every handler: zero the counters the kernel accumulates into (timeouts and
// the like) on the stream, then launch; CUDA errors become ffi::Error naming `what`.
template <class Launch>
ffi::Error clear_then_launch(cudaStream_t stream, std::initializer_list<ffi::AnyBuffer> cleared,
                             const char* what, Launch launch) {
  for (const ffi::AnyBuffer& buffer : cleared) {
    cudaError_t err = cudaMemsetAsync(buffer.untyped_data(), 0, buffer.size_bytes(), stream);
    if (err != cudaSuccess) return ffi_util::cuda_error(err, std::string(what) + " (memset)");
  }
  return ffi_util::cuda_error(launch(), what);
}

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
  return clear_then_launch(stream, {*timeouts}, "tma round trip launch",
                           [&] { return testing::launch_tma_round_trip(args, stream); });
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
  return clear_then_launch(stream, {*timeouts}, "tma reduce-add launch",
                           [&] { return testing::launch_tma_reduce_add(args, stream); });
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
  return clear_then_launch(stream, {*timeouts}, "tma multicast launch",
                           [&] { return testing::launch_tma_multicast(args, stream); });
}

ffi::Error pair_math(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> product,
                     int64_t half) {
  const size_t n = a.element_count();
  for (const ffi::AnyBuffer* x : {&a, &b, &*sum, &*product}) {
    if (x->element_type() != ffi::DataType::U32 || x->element_count() != n) {
      return ffi::Error::InvalidArgument("pair_math: a, b, sum and product must be u32[n]");
    }
  }
  const PairMathArgs args{static_cast<const uint32_t*>(a.untyped_data()),
                          static_cast<const uint32_t*>(b.untyped_data()),
                          static_cast<uint32_t*>(sum->untyped_data()),
                          static_cast<uint32_t*>(product->untyped_data()),
                          static_cast<int64_t>(n), half != 0};
  return ffi_util::cuda_error(testing::launch_pair_math(args, stream), "pair_math");
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
  return clear_then_launch(stream, {*timeouts}, "pipeline phase launch",
                           [&] { return testing::launch_pipeline_phases(args, stream); });
}

// Rejects a value (stage count, cluster size, ...) no test kernel is instantiated for.
ffi::Error check_choice(const char* what, int64_t value, std::initializer_list<int64_t> allowed) {
  for (int64_t a : allowed) {
    if (value == a) return ffi::Error::Success();
  }
  std::string message = std::string(what) + " must be one of";
  for (int64_t a : allowed) message += " " + std::to_string(a);
  return ffi::Error::InvalidArgument(message + ", got " + std::to_string(value));
}

bool is_shape(const ffi::AnyBuffer& b, ffi::DataType type, std::initializer_list<int64_t> dims) {
  if (b.element_type() != type || b.dimensions().size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t d : dims) {
    if (b.dimensions()[i++] != d) return false;
  }
  return true;
}

ffi::Error tensormap_replace(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer groups,
                             ffi::Result<ffi::AnyBuffer> images,
                             ffi::Result<ffi::AnyBuffer> workspace,
                             ffi::Result<ffi::AnyBuffer> timeouts,
                             ffi::Span<const int64_t> template_shape, ffi::Span<const int64_t> box,
                             int64_t timeout_cycles) {
  CUtensorMapDataType dtype;
  if (!tma_type(x.element_type(), &dtype)) {
    return ffi::Error::InvalidArgument("tensormap test: unsupported element type");
  }
  const auto group_dims = groups.dimensions();
  if (groups.element_type() != ffi::DataType::S32 || group_dims.size() != 2 ||
      group_dims[1] != 4 || group_dims[0] < 1) {
    return ffi::Error::InvalidArgument("tensormap test: groups must be int32 [G, 4]");
  }
  if (template_shape.size() != 3 || box.size() != 2) {
    return ffi::Error::InvalidArgument(
        "tensormap test: template is (rows, cols, row stride), box is (rows, cols)");
  }
  const int64_t rows = template_shape[0], cols = template_shape[1], stride = template_shape[2];
  if (rows < 1 || cols < 1 ||
      (rows - 1) * stride + cols > static_cast<int64_t>(x.element_count())) {
    return ffi::Error::InvalidArgument("tensormap test: the template reaches past x");
  }
  const auto spec = ffi_util::make_2d_spec(dtype, rows, cols, stride, box[0], box[1],
                                           ffi_util::Swizzle::kNone);
  CUtensorMap map_template;
  if (auto err = encode(&map_template, x.untyped_data(), spec); err.failure()) return err;
  TensormapReplaceArgs args{};
  args.map_template = &map_template;
  args.base = static_cast<const uint8_t*>(x.untyped_data());
  args.element_bytes = ffi_util::tensor_map_element_bytes(dtype);
  args.groups = static_cast<const int32_t*>(groups.untyped_data());
  args.num_groups = static_cast<int>(group_dims[0]);
  args.workspace = static_cast<CUtensorMap*>(workspace->untyped_data());
  args.box_bytes = box_bytes_of(spec);
  if (args.box_bytes > kMaxTestBoxBytes ||
      images->size_bytes() != static_cast<size_t>(args.num_groups) * args.box_bytes) {
    return ffi::Error::InvalidArgument("tensormap test: images must be [G, box bytes]");
  }
  if (workspace->size_bytes() != args.num_groups * sizeof(CUtensorMap) ||
      reinterpret_cast<uintptr_t>(args.workspace) % 64 != 0) {
    return ffi::Error::InvalidArgument(
        "tensormap test: workspace must be G x 128 bytes, 64-byte aligned");
  }
  args.images = static_cast<uint8_t*>(images->untyped_data());
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  return clear_then_launch(stream, {*timeouts}, "tensormap replace launch",
                           [&] { return testing::launch_tensormap_replace(args, stream); });
}

ffi::Error cp_async_pipeline(cudaStream_t stream, ffi::AnyBuffer src,
                             ffi::Result<ffi::AnyBuffer> dst, ffi::Result<ffi::AnyBuffer> timeouts,
                             int64_t stages, int64_t consumers, int64_t full_arrivals,
                             int64_t timeout_cycles) {
  if (auto err = check_choice("cp.async test: stages", stages, {2, 4}); err.failure()) return err;
  if (consumers < 1 || consumers > 8) {
    return ffi::Error::InvalidArgument("cp.async test: consumers must be 1..8");
  }
  const uint64_t chunk = testing::kCpAsyncChunkBytes;
  const uint64_t padded = (src.size_bytes() + chunk - 1) / chunk * chunk;
  if (src.size_bytes() == 0 || dst->size_bytes() != padded) {
    return ffi::Error::InvalidArgument("cp.async test: dst must hold the source rounded up to " +
                                       std::to_string(chunk) + "-byte chunks (" +
                                       std::to_string(padded) + " bytes)");
  }
  CpAsyncPipelineArgs args{};
  args.stages = static_cast<int>(stages);
  args.consumers = static_cast<int>(consumers);
  args.src = static_cast<const uint8_t*>(src.untyped_data());
  args.bytes = src.size_bytes();
  args.dst = static_cast<uint8_t*>(dst->untyped_data());
  args.full_arrivals = static_cast<uint32_t>(full_arrivals);
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  return clear_then_launch(stream, {*timeouts}, "cp.async pipeline launch",
                           [&] { return testing::launch_cp_async_pipeline(args, stream); });
}

constexpr int64_t kMaxDsmemWords = 16384;

ffi::Error dsmem_ring(cudaStream_t stream, ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> dst,
                      ffi::Result<ffi::AnyBuffer> timeouts, int64_t extra_tx_bytes,
                      int64_t timeout_cycles) {
  const auto dims = src.dimensions();
  if (src.element_type() != ffi::DataType::U32 || dims.size() != 2 ||
      (dims[0] != 2 && dims[0] != 4) || dims[1] < 1 || dims[1] > kMaxDsmemWords ||
      !is_shape(*dst, ffi::DataType::U32, {dims[0], dims[1]})) {
    return ffi::Error::InvalidArgument("dsmem test: src and dst must be uint32 [2 or 4, words], "
                                       "words 1.." + std::to_string(kMaxDsmemWords));
  }
  DsmemRingArgs args{};
  args.cluster_size = static_cast<int>(dims[0]);
  args.src = static_cast<const uint32_t*>(src.untyped_data());
  args.words = static_cast<int>(dims[1]);
  args.extra_tx_bytes = static_cast<uint32_t>(extra_tx_bytes);
  args.dst = static_cast<uint32_t*>(dst->untyped_data());
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  return clear_then_launch(stream, {*timeouts}, "dsmem ring launch",
                           [&] { return testing::launch_dsmem_ring(args, stream); });
}

// Spec of a contiguous 2-D buffer whose boxes are `box_rows` full rows.
ffi::Error row_box_spec(const ffi::AnyBuffer& x, int64_t box_rows, ffi_util::TensorMapSpec* spec) {
  if (x.dimensions().size() != 2) return ffi::Error::InvalidArgument("expected a 2-D tensor");
  const int64_t box[2] = {box_rows, x.dimensions()[1]};
  return contiguous_spec(x, ffi::Span<const int64_t>(box, 2), 0, spec);
}

ffi::Error tma_multicast_pipeline(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer y,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> releases,
                                  ffi::Result<ffi::AnyBuffer> tail_releases,
                                  ffi::Result<ffi::AnyBuffer> timeouts, int64_t stages,
                                  int64_t cluster_size, int64_t consumers, int64_t iterations,
                                  int64_t slice_rows, int64_t y_rows, int64_t slow_cta,
                                  int64_t extra_empty_arrivals, int64_t timeout_cycles) {
  if (auto err = check_choice("multicast pipeline: stages", stages, {2, 3, 4}); err.failure()) {
    return err;
  }
  if (auto err = check_choice("multicast pipeline: cluster size", cluster_size, {2, 4});
      err.failure()) {
    return err;
  }
  if (auto err = check_choice("multicast pipeline: consumers", consumers, {1, 2}); err.failure()) {
    return err;
  }
  ffi_util::TensorMapSpec spec_x, spec_y;
  if (auto err = row_box_spec(x, slice_rows, &spec_x); err.failure()) return err;
  if (auto err = row_box_spec(y, y_rows, &spec_y); err.failure()) return err;
  if (x.dimensions()[0] != iterations * cluster_size * slice_rows ||
      y.dimensions()[0] != cluster_size * iterations * y_rows) {
    return ffi::Error::InvalidArgument("multicast pipeline: x must have iterations x cluster size "
                                       "x slice rows rows, y cluster size x iterations x y rows");
  }
  TmaMulticastPipelineArgs args{};
  args.slice_bytes = box_bytes_of(spec_x);
  args.y_bytes = box_bytes_of(spec_y);
  const uint64_t stage_bytes = cluster_size * args.slice_bytes + args.y_bytes;
  if (args.slice_bytes % 128 != 0 || args.y_bytes % 128 != 0 ||
      stages * stage_bytes > kMaxTestBoxBytes) {
    return ffi::Error::InvalidArgument("multicast pipeline: tiles must be multiples of 128 bytes "
                                       "and the ring must fit in shared memory");
  }
  if (out->size_bytes() != cluster_size * iterations * stage_bytes ||
      !is_shape(*releases, ffi::DataType::S32, {cluster_size}) ||
      !is_shape(*tail_releases, ffi::DataType::S32, {cluster_size})) {
    return ffi::Error::InvalidArgument("multicast pipeline: out must be [cluster size, iterations, "
                                       "stage bytes], releases int32 [cluster size]");
  }
  CUtensorMap map_x, map_y;
  if (auto err = encode(&map_x, x.untyped_data(), spec_x); err.failure()) return err;
  if (auto err = encode(&map_y, y.untyped_data(), spec_y); err.failure()) return err;
  args.map_x = &map_x;
  args.map_y = &map_y;
  args.stages = static_cast<int>(stages);
  args.cluster_size = static_cast<int>(cluster_size);
  args.consumers = static_cast<int>(consumers);
  args.iterations = static_cast<int>(iterations);
  args.slice_rows = static_cast<int>(slice_rows);
  args.y_rows = static_cast<int>(y_rows);
  args.slow_cta = static_cast<int>(slow_cta);
  args.extra_empty_arrivals = static_cast<uint32_t>(extra_empty_arrivals);
  args.out = static_cast<uint8_t*>(out->untyped_data());
  args.releases = static_cast<int32_t*>(releases->untyped_data());
  args.tail_releases = static_cast<int32_t*>(tail_releases->untyped_data());
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  return clear_then_launch(stream, {*timeouts, *releases, *tail_releases},
                           "tma multicast pipeline launch",
                           [&] { return testing::launch_tma_multicast_pipeline(args, stream); });
}

ffi::Error tma_store_pipeline(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> out,
                              int64_t stages) {
  if (auto err = check_choice("store pipeline: stages", stages, {2, 4}); err.failure()) return err;
  const auto dims = out->dimensions();
  if (out->element_type() != ffi::DataType::S32 || dims.size() != 2 ||
      dims[1] != testing::kStoreTileCols || dims[0] % testing::kStoreTileRows != 0) {
    return ffi::Error::InvalidArgument("store pipeline: out must be int32 [iterations x " +
                                       std::to_string(testing::kStoreTileRows) + ", " +
                                       std::to_string(testing::kStoreTileCols) + "]");
  }
  const auto spec = ffi_util::make_2d_spec(
      CU_TENSOR_MAP_DATA_TYPE_INT32, dims[0], dims[1], dims[1], testing::kStoreTileRows,
      testing::kStoreTileCols, ffi_util::Swizzle::kNone);
  CUtensorMap map_out;
  if (auto err = encode(&map_out, out->untyped_data(), spec); err.failure()) return err;
  const TmaStorePipelineArgs args{&map_out, static_cast<int>(stages),
                                  static_cast<int>(dims[0] / testing::kStoreTileRows)};
  return ffi_util::cuda_error(testing::launch_tma_store_pipeline(args, stream),
                              "tma store pipeline launch");
}

ffi::Error named_barrier_ping_pong(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> seen) {
  const auto dims = seen->dimensions();
  if (seen->element_type() != ffi::DataType::S32 || dims.size() != 2 || dims[1] != 128) {
    return ffi::Error::InvalidArgument("named barrier test: seen must be int32 [iterations, 128]");
  }
  const NamedBarrierArgs args{static_cast<int>(dims[0]),
                              static_cast<int32_t*>(seen->untyped_data())};
  return ffi_util::cuda_error(testing::launch_named_barrier_ping_pong(args, stream),
                              "named barrier launch");
}

ffi::Error ordered_barrier(cudaStream_t stream, ffi::Result<ffi::AnyBuffer> counters,
                           ffi::Result<ffi::AnyBuffer> log, ffi::Result<ffi::AnyBuffer> timeouts,
                           int64_t groups, int64_t timeout_cycles) {
  if (auto err = check_choice("ordered barrier: groups", groups, {2, 3}); err.failure()) return err;
  const auto dims = log->dimensions();
  if (!is_shape(*counters, ffi::DataType::S32, {2}) || log->element_type() != ffi::DataType::S32 ||
      dims.size() != 2 || dims[0] != 2 || dims[1] % groups != 0) {
    return ffi::Error::InvalidArgument(
        "ordered barrier: counters must be int32 [2], log int32 [2, groups x passes]");
  }
  OrderedBarrierArgs args{};
  args.groups = static_cast<int>(groups);
  args.passes = static_cast<int>(dims[1] / groups);
  args.counters = static_cast<int32_t*>(counters->untyped_data());
  args.log = static_cast<int32_t*>(log->untyped_data());
  args.timeouts = static_cast<int32_t*>(timeouts->untyped_data());
  args.timeout_cycles = static_cast<uint64_t>(timeout_cycles);
  return clear_then_launch(stream, {*timeouts}, "ordered barrier launch",
                           [&] { return testing::launch_ordered_barrier(args, stream); });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestPairMath, pair_math,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // a u32[n]
                                  .Arg<ffi::AnyBuffer>()                      // b u32[n]
                                  .Ret<ffi::AnyBuffer>()                      // sum u32[n]
                                  .Ret<ffi::AnyBuffer>()                      // product u32[n]
                                  .Attr<int64_t>("half"));                    // fp16, not bf16

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestPipelinePhases, pipeline_phases,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ret<ffi::AnyBuffer>()                      // seen s32
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestTensormapReplace, tensormap_replace,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // x, flat
                                  .Arg<ffi::AnyBuffer>()                      // groups s32[G, 4]
                                  .Ret<ffi::AnyBuffer>()                      // images u8
                                  .Ret<ffi::AnyBuffer>()                      // maps u8[G, 128]
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<ffi::Span<const int64_t>>("template")  // rows, cols, stride
                                  .Attr<ffi::Span<const int64_t>>("box")       // rows, cols
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestCpAsyncPipeline, cp_async_pipeline,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // src
                                  .Ret<ffi::AnyBuffer>()                      // dst, whole chunks
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("consumers")                 // warps
                                  .Attr<int64_t>("full_arrivals")             // 32 is right
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestDsmemRing, dsmem_ring,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // src u32[C, words]
                                  .Ret<ffi::AnyBuffer>()                      // dst u32[C, words]
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<int64_t>("extra_tx_bytes")            // 0 is right
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestTmaMulticastPipeline, tma_multicast_pipeline,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Arg<ffi::AnyBuffer>()                      // x (shared tiles)
                                  .Arg<ffi::AnyBuffer>()                      // y (private tiles)
                                  .Ret<ffi::AnyBuffer>()                      // out u8
                                  .Ret<ffi::AnyBuffer>()                      // releases s32[C]
                                  .Ret<ffi::AnyBuffer>()                      // at tail s32[C]
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("cluster_size")
                                  .Attr<int64_t>("consumers")                 // warps per CTA
                                  .Attr<int64_t>("iterations")
                                  .Attr<int64_t>("slice_rows")
                                  .Attr<int64_t>("y_rows")
                                  .Attr<int64_t>("slow_cta")
                                  .Attr<int64_t>("extra_empty_arrivals")      // 0 is right
                                  .Attr<int64_t>("timeout_cycles"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestTmaStorePipeline, tma_store_pipeline,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ret<ffi::AnyBuffer>()                      // out s32
                                  .Attr<int64_t>("stages"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestNamedBarrierPingPong, named_barrier_ping_pong,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ret<ffi::AnyBuffer>());                    // seen s32

XLA_FFI_DEFINE_HANDLER_SYMBOL(TestOrderedBarrier, ordered_barrier,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // launch stream
                                  .Ret<ffi::AnyBuffer>()                      // counters s32[2]
                                  .Ret<ffi::AnyBuffer>()                      // log s32[2, n]
                                  .Ret<ffi::AnyBuffer>()                      // timeouts s32[1]
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("timeout_cycles"));

}  // namespace jax_tma::ffi_handlers
