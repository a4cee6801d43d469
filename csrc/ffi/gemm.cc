// XLA FFI handler for the batched, strided GEMM on Hopper (sm_90a): argument checks,
// tensor-map encoding and the launch of the kernel that the attributes name.
//
// For b in [0, batch): D[b] = A[b] @ B[b]. Each operand is a strided view into its flat buffer
// (any rank, read as element_count() elements), strides in elements:
//   A (b, m, k)    at b * a_batch_stride + m * a_m_stride + k * a_k_stride
//   B (b, k, n)    at b * b_batch_stride + k * b_k_stride + n * b_n_stride
//   D (s, b, m, n) at s * d_split_stride + b * d_batch_stride + m * d_m_stride + n
// A is K-major when a_k_stride == 1, else M-major (a_m_stride == 1); B is N-major when
// b_n_stride == 1, else K-major (b_k_stride == 1). A batch stride of 0 shares that operand
// across the batch. Every other stride TMA reads or writes is a multiple of 16 bytes. A and B
// are both bf16 or both fp16, D their type or fp32 (fp32 when splits > 1: one partial product
// per K range, for the caller to sum). block_m, block_n, stages, cluster_m and epilogue name
// one tile configuration compiled in contract/sm90_gemm.h; the strides pick its layout.
// stream_k = 1 deals the last wave's K slices out to the whole grid (scheduler/tile_scheduler.cuh),
// with the second result as its workspace (sm90_gemm::stream_k_workspace_bytes; any size when
// stream_k = 0, which leaves it untouched).
#include "ffi/gemm.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "ffi/checks.h"
#include "ffi/cuda_check.h"
#include "ffi/device_info.h"
#include "ffi/dispatch.h"
#include "ffi/gemm_maps.h"
#include "ffi/tensor_map.h"
#include "contract/sm90_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {

// The attributes of both handlers (decoded by name: XLA_FFI_REGISTER_STRUCT_ATTR_DECODING below).
struct GemmAttrs {
  int64_t block_m, block_n, stages, cluster_m, epilogue, splits, stream_k;
  int64_t m, n, k, batch;
  int64_t a_batch_stride, a_m_stride, a_k_stride;
  int64_t b_batch_stride, b_k_stride, b_n_stride;
  int64_t d_split_stride, d_batch_stride, d_m_stride;
};

namespace {

constexpr char kOp[] = "jax_tma gemm";  // every message's prefix

using ffi_util::operand_spec;
using ffi_util::str;
using ffi_util::ViewDim;
using sm90_gemm::DType;
using sm90_gemm::LaunchArgs;
using sm90_gemm::Major;

// Which operand layout the strides describe (validated before).
struct LayoutChoice {
  Major a, b;
};

template <class Layout>
bool layout_matches(const LayoutChoice& c) {
  return Layout::kA == c.a && Layout::kB == c.b;
}

template <class In, class Tile, class Layout>
cudaError_t launch_out(DType out, const LaunchArgs& args) {
  if (out == DType::kF32) return sm90_gemm::launch<In, float, Tile, Layout>(args);
  return sm90_gemm::launch<In, In, Tile, Layout>(args);
}

// Everything about one call that the checks established.
struct Call {
  DType in, out;
  LayoutChoice layout;
  const ffi::AnyBuffer* a;
  const ffi::AnyBuffer* b;
  void* d;
  LaunchArgs args;
};

template <class Tile, class Layout>
ffi::Error run(const GemmAttrs& p, Call call) {
  using Boxes = sm90_gemm::OperandBoxes<Tile, Layout>;
  if (p.stream_k && !Tile::kStreamK) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: stream_k=1 needs a 128-row tile without a cluster (cluster_m=1), got "
        "block_m=" + str(p.block_m) + ", cluster_m=" + str(p.cluster_m));
  }
  // The scheduler's units: (split, batch entry, cluster of M tiles, N tile).
  const int64_t m_blocks = (p.m + Tile::kBlockM - 1) / Tile::kBlockM;
  const int64_t units = (m_blocks + Tile::kClusterM - 1) / Tile::kClusterM *
                        ((p.n + Tile::kBlockN - 1) / Tile::kBlockN) * p.batch * p.splits;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_work_units(kOp, units, "", [&] {
    return " (splits=" + str(p.splits) + " x batch=" + str(p.batch) + " x tiles of m=" + str(p.m) +
           ", n=" + str(p.n) + ")";
  }));
  const int64_t batch_a = call.args.shape.a_batched ? p.batch : 1;
  const int64_t batch_b = call.args.shape.b_batched ? p.batch : 1;
  const int a_rows = Boxes::a_rows(p.m);
  const int box_a[3] = {Boxes::kBoxA[0], Boxes::kAKMajor ? a_rows : Boxes::kBoxA[1],
                        Boxes::kBoxA[2]};
  call.args.shape.a_stage_bytes = Boxes::a_stage_bytes(p.m);
  const auto spec_a = operand_spec<Layout::kA>(
      call.in, {p.m, p.a_m_stride, "a_m_stride"}, {p.k, p.a_k_stride, "a_k_stride"},
      {batch_a, p.a_batch_stride, "a_batch_stride"}, box_a);
  const auto spec_b = operand_spec<Layout::kB>(
      call.in, {p.n, p.b_n_stride, "b_n_stride"}, {p.k, p.b_k_stride, "b_k_stride"},
      {batch_b, p.b_batch_stride, "b_batch_stride"}, Boxes::kBoxB);
  CUtensorMap map_a, map_b, map_d = {};
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::encode("jax_tma gemm, operand a", &map_a, call.a->untyped_data(), spec_a));
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::encode("jax_tma gemm, operand b", &map_b, call.b->untyped_data(), spec_b));
  if constexpr (Tile::kEpilogue == sm90_gemm::EpilogueKind::kTmaStore) {
    // D [splits, batch, M, N] in boxes of one epilogue chunk: 64 rows x 128 bytes.
    const auto spec_d = ffi_util::output_spec(
        call.out, {p.n, 1, "n"}, {p.m, p.d_m_stride, "d_m_stride"},
        {p.batch, p.d_batch_stride, "d_batch_stride"},
        {p.splits, p.d_split_stride, "d_split_stride"}, Tile::kEpilogueRowBytes,
        Tile::kEpilogueRows);
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode("jax_tma gemm, output", &map_d, call.d, spec_d));
  }
  call.args.tmap_a = &map_a;
  call.args.tmap_b = &map_b;
  call.args.tmap_d = &map_d;
  call.args.d = call.d;
  const cudaError_t launched =
      call.in == DType::kBF16 ? launch_out<__nv_bfloat16, Tile, Layout>(call.out, call.args)
                              : launch_out<__half, Tile, Layout>(call.out, call.args);
  return ffi_util::cuda_error(launched, "jax_tma gemm launch");
}

#define JAX_TMA_KERNEL(TILE, LAYOUT) ffi_util::Kernel<sm90_gemm::TILE, sm90_gemm::LAYOUT>,
using Kernels = ffi_util::KernelList<JAX_TMA_SM90_GEMM_KERNELS(JAX_TMA_KERNEL) void>;
#undef JAX_TMA_KERNEL

// run<Tile, Layout> for the compiled kernel that the attributes and strides name.
ffi::Error dispatch(const GemmAttrs& p, const Call& call) {
  return ffi_util::dispatch(
      Kernels{}, p,
      [&](auto kernel) { return layout_matches<typename decltype(kernel)::Layout>(call.layout); },
      [&](auto kernel) {
        using K = decltype(kernel);
        return run<typename K::Tile, typename K::Layout>(p, call);
      },
      [&] { return ffi_util::no_configuration(kOp, p, ", epilogue=" + str(p.epilogue)); });
}

// An operand's layout from its strides: the dimension with unit stride is the contiguous one;
// when both have one (a dimension of size 1), `tie` wins. False when neither has.
bool major_of(int64_t k_stride, int64_t mn_stride, Major tie, Major* major) {
  const bool k_unit = k_stride == 1, mn_unit = mn_stride == 1;
  if (!k_unit && !mn_unit) return false;
  *major = k_unit && mn_unit ? tie : (k_unit ? Major::kK : Major::kMN);
  return true;
}

// The handlers' implementation (the binding follows from its parameters: ffi/dispatch.h).
ffi::Error gemm_sm90(cudaStream_t stream, int32_t device,
                     ffi::AnyBuffer a,                       // flat, strided view
                     ffi::AnyBuffer b,                       // flat, strided view
                     ffi::Result<ffi::AnyBuffer> d_result,   // flat, strided view
                     ffi::Result<ffi::AnyBuffer> workspace,  // stream-K workspace
                     GemmAttrs p) {
  ffi::AnyBuffer& d = *d_result;
  const std::string dims =
      "m=" + str(p.m) + ", n=" + str(p.n) + ", k=" + str(p.k) + ", batch=" + str(p.batch);
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::check_sizes(kOp, "m, n, k and batch", {p.m, p.n, p.k, p.batch}, 31, dims));
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_non_negative(
      kOp, "strides",
      {{"a_batch_stride", p.a_batch_stride}, {"a_m_stride", p.a_m_stride},
       {"a_k_stride", p.a_k_stride}, {"b_batch_stride", p.b_batch_stride},
       {"b_k_stride", p.b_k_stride}, {"b_n_stride", p.b_n_stride},
       {"d_split_stride", p.d_split_stride}, {"d_batch_stride", p.d_batch_stride},
       {"d_m_stride", p.d_m_stride}}));

  Call call{};
  DType in_b;
  if (!ffi_util::to_dtype(a.element_type(), &call.in) ||
      !ffi_util::to_dtype(b.element_type(), &in_b) || call.in != in_b || call.in == DType::kF32 ||
      !ffi_util::to_dtype(d.element_type(), &call.out) ||
      (call.out != call.in && call.out != DType::kF32)) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: a and b must both be bf16 or both fp16, and d their type or fp32");
  }

  // Layouts: one unit stride per operand, on K or on the other dimension.
  if (!major_of(p.a_k_stride, p.a_m_stride, Major::kK, &call.layout.a) ||
      !major_of(p.b_k_stride, p.b_n_stride, Major::kMN, &call.layout.b)) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: a must be K-major (a_k_stride=1) or M-major (a_m_stride=1) and b N-major "
        "(b_n_stride=1) or K-major (b_k_stride=1), got a_m_stride=" + str(p.a_m_stride) +
        ", a_k_stride=" + str(p.a_k_stride) + ", b_k_stride=" + str(p.b_k_stride) +
        ", b_n_stride=" + str(p.b_n_stride));
  }

  if (p.stream_k != 0 && (p.stream_k != 1 || p.splits != 1)) {
    return ffi::Error::InvalidArgument(
        "jax_tma gemm: stream_k must be 0 or 1, and 1 only without split-K, got stream_k=" +
        str(p.stream_k) + ", splits=" + str(p.splits));
  }
  int64_t per_split = 0;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_splits(kOp, p.splits, (p.k + 63) / 64, 64,
                                                 call.out == DType::kF32, dims, &per_split));

  // A batch stride of 0 (or a batch of 1) shares the operand: its map has one batch index.
  const bool a_batched = p.batch > 1 && p.a_batch_stride != 0;
  const bool b_batched = p.batch > 1 && p.b_batch_stride != 0;
  const std::initializer_list<ViewDim> view_a = {{a_batched ? p.batch : 1, p.a_batch_stride,
                                                  "a_batch_stride"},
                                                 {p.m, p.a_m_stride, "a_m_stride"},
                                                 {p.k, p.a_k_stride, "a_k_stride"}};
  const std::initializer_list<ViewDim> view_b = {{b_batched ? p.batch : 1, p.b_batch_stride,
                                                  "b_batch_stride"},
                                                 {p.k, p.b_k_stride, "b_k_stride"},
                                                 {p.n, p.b_n_stride, "b_n_stride"}};
  const std::initializer_list<ViewDim> view_d = {{p.splits, p.d_split_stride, "d_split_stride"},
                                                 {p.batch, p.d_batch_stride, "d_batch_stride"},
                                                 {p.m, p.d_m_stride, "d_m_stride"},
                                                 {p.n, 1, "n"}};
  const std::string context = dims + ", splits=" + str(p.splits);
  for (const std::string& e :
       {ffi_util::check_in_bounds("a", view_a, a.element_count(), context),
        ffi_util::check_in_bounds("b", view_b, b.element_count(), context),
        ffi_util::check_in_bounds("d", view_d, d.element_count(), context)}) {
    JAX_TMA_RETURN_IF_ERROR(ffi_util::invalid_if(kOp, e));
  }
  // Writing one output element twice would race.
  for (const ViewDim& v : view_d) {
    if (v.extent > 1 && v.stride == 0) {
      return ffi::Error::InvalidArgument(std::string("jax_tma gemm: ") + v.name +
                                         "=0 makes d's elements alias (" + dims +
                                         ", splits=" + str(p.splits) + ")");
    }
  }

  // TMA strides: every dimension but the contiguous one of A, B and (TMA store) D.
  const int64_t in_bytes = sm90_gemm::dtype_bytes(call.in);
  const ViewDim a_outer = call.layout.a == Major::kK ? ViewDim{p.m, p.a_m_stride, "a_m_stride"}
                                                     : ViewDim{p.k, p.a_k_stride, "a_k_stride"};
  const ViewDim b_outer = call.layout.b == Major::kK ? ViewDim{p.n, p.b_n_stride, "b_n_stride"}
                                                     : ViewDim{p.k, p.b_k_stride, "b_k_stride"};
  std::string err = ffi_util::check_tma_strides(
      "a", {a_outer, {a_batched ? p.batch : 1, p.a_batch_stride, "a_batch_stride"}}, in_bytes);
  if (err.empty()) {
    err = ffi_util::check_tma_strides(
        "b", {b_outer, {b_batched ? p.batch : 1, p.b_batch_stride, "b_batch_stride"}}, in_bytes);
  }
  if (err.empty() && p.epilogue == static_cast<int64_t>(sm90_gemm::EpilogueKind::kTmaStore)) {
    err = ffi_util::check_tma_strides("d (TMA-store epilogue)",
                            {{p.m, p.d_m_stride, "d_m_stride"},
                             {p.batch, p.d_batch_stride, "d_batch_stride"},
                             {p.splits, p.d_split_stride, "d_split_stride"}},
                            sm90_gemm::dtype_bytes(call.out));
  }
  if (!err.empty()) return ffi_util::invalid_if(kOp, err + " (" + dims + ")");

  const ffi_util::DeviceInfo* info = nullptr;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sm90_device(kOp, device, &info));

  call.a = &a;
  call.b = &b;
  call.d = d.untyped_data();
  call.args.shape =
      ffi_util::problem_shape(p.m, p.n, p.k, p.batch, p.splits, per_split, a_batched, b_batched);
  call.args.shape.d_m_stride = p.d_m_stride;
  call.args.shape.d_batch_stride = p.d_batch_stride;
  call.args.shape.d_split_stride = p.d_split_stride;
  call.args.num_sms = info->num_sms;
  call.args.stream = stream;
  call.args.stream_k = p.stream_k == 1;
  call.args.workspace = workspace->untyped_data();
  call.args.workspace_bytes = static_cast<int64_t>(workspace->size_bytes());
  return dispatch(p, call);
}

}  // namespace
}  // namespace jax_tma::ffi_handlers

// The attributes both handlers take, decoded by name into GemmAttrs (every one required).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::GemmAttrs,
    xla::ffi::StructMember<int64_t>("block_m"),         // tile M
    xla::ffi::StructMember<int64_t>("block_n"),         // tile N
    xla::ffi::StructMember<int64_t>("stages"),          // pipeline depth
    xla::ffi::StructMember<int64_t>("cluster_m"),       // CTAs per cluster
    xla::ffi::StructMember<int64_t>("epilogue"),        // EpilogueKind
    xla::ffi::StructMember<int64_t>("splits"),          // split-K ranges
    xla::ffi::StructMember<int64_t>("stream_k"),        // 1: stream-K last wave
    xla::ffi::StructMember<int64_t>("m"),               // rows of each D[b]
    xla::ffi::StructMember<int64_t>("n"),               // columns of each D[b]
    xla::ffi::StructMember<int64_t>("k"),               // contraction length
    xla::ffi::StructMember<int64_t>("batch"),           // products
    xla::ffi::StructMember<int64_t>("a_batch_stride"),  // 0: A shared by every product
    xla::ffi::StructMember<int64_t>("a_m_stride"),
    xla::ffi::StructMember<int64_t>("a_k_stride"),
    xla::ffi::StructMember<int64_t>("b_batch_stride"),  // 0: B shared by every product
    xla::ffi::StructMember<int64_t>("b_k_stride"),
    xla::ffi::StructMember<int64_t>("b_n_stride"),
    xla::ffi::StructMember<int64_t>("d_split_stride"),
    xla::ffi::StructMember<int64_t>("d_batch_stride"),
    xla::ffi::StructMember<int64_t>("d_m_stride"));

namespace jax_tma::ffi_handlers {

// GemmSm90Into takes d_in after b, aliased to d.
JAX_TMA_DEFINE_HANDLER_PAIR(GemmSm90, GemmSm90Into, gemm_sm90, 1);

}  // namespace jax_tma::ffi_handlers
