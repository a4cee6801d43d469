// XLA FFI handler of the grouped (ragged) products on Hopper (sm_90a): argument checks, the
// tensor maps (and the templates the prepare kernel edits per segment), and the launch of the
// kernel pair that the attributes name (contract/sm90_ragged_dot.h describes both modes).
//
// Dense row-major operands, `batch` entries of `rows` rows each, `groups` groups:
//   mode 0 (rows):        x [batch, rows, k], w [groups or batch x groups, k, n] (w_k_major=0)
//                         or [.., n, k] (w_k_major=1), group_sizes [batch or 1, groups] int32
//                         -> out [batch, rows, n]
//   mode 1 (contraction): x [batch, rows, k], dy [batch, rows, n], group_sizes as above
//                         -> out [batch, groups, k, n]
// The second result is the workspace (sm90_gemm::ragged_workspace_bytes). Inputs bf16 or fp16,
// out their type or fp32; rows of every operand and of out are 16-byte multiples.
#include "ffi/ragged_dot.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "ffi/checks.h"
#include "ffi/cuda_check.h"
#include "ffi/device_info.h"
#include "ffi/dispatch.h"
#include "ffi/gemm_maps.h"
#include "ffi/tensor_map.h"
#include "contract/sm90_gemm.h"
#include "contract/sm90_ragged_dot.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {

struct RaggedAttrs {
  int64_t mode, block_m, block_n, stages, cluster_m;
  int64_t rows, n, k, groups, batch;
  int64_t weights_batched, group_sizes_batched, w_k_major;
};

namespace {

constexpr char kOp[] = "jax_tma ragged_dot";  // every message's prefix

using ffi_util::str;
using ffi_util::ViewDim;
using sm90_gemm::DType;
using sm90_gemm::LaunchArgs;
using sm90_gemm::Major;
using sm90_gemm::RaggedArgs;
using sm90_gemm::RaggedMode;

struct Call {
  DType in, out;
  const ffi::AnyBuffer* x;
  const ffi::AnyBuffer* w;  // rows mode: the weights; contraction mode: dy
  void* out_data;
  LaunchArgs args;
  RaggedArgs ragged;
};

template <class In, class Tile, class Layout, RaggedMode kMode>
cudaError_t launch_out(const Call& call) {
  if (call.out == DType::kF32) {
    return sm90_gemm::launch_ragged<In, float, Tile, Layout, kMode>(call.args, call.ragged);
  }
  return sm90_gemm::launch_ragged<In, In, Tile, Layout, kMode>(call.args, call.ragged);
}

template <class Tile, class Layout, RaggedMode kMode>
ffi::Error run(const RaggedAttrs& p, Call call) {
  using Boxes = sm90_gemm::OperandBoxes<Tile, Layout>;
  constexpr bool kRows = kMode == RaggedMode::kRows;
  const int64_t stacked = p.batch * p.rows;
  const int64_t weights = p.weights_batched ? p.batch * p.groups : p.groups;
  const int64_t segments = sm90_gemm::ragged_segments(kMode, p.groups, p.batch);
  // NOTE: in rows mode each segment's row blocks round up once, and the numbering pads at most
  // two blocks per batch entry and one at the end: stacked / block_m + segments + 2 batch + 1.
  const int64_t n_blocks = (p.n + Tile::kBlockN - 1) / Tile::kBlockN;
  const int64_t units =
      kRows ? (stacked / Tile::kBlockM + segments + 2 * p.batch + 1) * n_blocks
            : (p.k + Tile::kBlockM - 1) / Tile::kBlockM * n_blocks * segments;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_work_units(kOp, units, "up to "));
  const int in_bytes = sm90_gemm::dtype_bytes(call.in);
  const int out_bytes = sm90_gemm::dtype_bytes(call.out);
  CUtensorMap map_a, map_b, map_d;
  void* x = call.x->untyped_data();
  void* w = call.w->untyped_data();
  if constexpr (kRows) {
    // A: the stacked rows, K-major; B: the weights, one batch entry per matrix; D's template:
    // the stacked output rows (the prepare kernel moves and cuts it per segment).
    const int box_a[3] = {Boxes::kBoxA[0], Boxes::a_rows(stacked), 1};
    call.args.shape.a_stage_bytes = Boxes::a_stage_bytes(stacked);
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        kOp, &map_a, x,
        ffi_util::operand_spec<Major::kK>(call.in, {stacked, p.k, "rows"}, {p.k, 1, "k"},
                                          {1, 0, "batch"}, box_a)));
    const ViewDim w_n = Layout::kB == Major::kK ? ViewDim{p.n, p.k, "n"} : ViewDim{p.n, 1, "n"};
    const ViewDim w_k = Layout::kB == Major::kK ? ViewDim{p.k, 1, "k"} : ViewDim{p.k, p.n, "k"};
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        kOp, &map_b, w,
        ffi_util::operand_spec<Layout::kB>(call.in, w_n, w_k, {weights, p.k * p.n, "groups"},
                                           Boxes::kBoxB)));
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        kOp, &map_d, call.out_data,
        ffi_util::output_spec(call.out, {p.n, 1, "n"}, {stacked, p.n, "rows"}, {1, 0, "batch"},
                              {1, 0, "split"}, Tile::kEpilogueRowBytes, Tile::kEpilogueRows)));
    call.args.shape.m = static_cast<int>(stacked);
    call.args.shape.k = static_cast<int>(p.k);
    call.ragged.templates[0] = call.ragged.templates[1] = &map_d;
    call.ragged.bases[0] = call.ragged.bases[1] = call.out_data;
    call.ragged.row_bytes[0] = call.ragged.row_bytes[1] = p.n * out_bytes;
  } else {
    // Templates of A (x read M-major: the product's M is x's k) and B (dy), both over the
    // stacked rows that the prepare kernel cuts per segment; D: [segments, k, n].
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        kOp, &map_a, x,
        ffi_util::operand_spec<Major::kMN>(call.in, {p.k, 1, "k"}, {stacked, p.k, "rows"},
                                           {1, 0, "batch"}, Boxes::kBoxA)));
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        kOp, &map_b, w,
        ffi_util::operand_spec<Major::kMN>(call.in, {p.n, 1, "n"}, {stacked, p.n, "rows"},
                                           {1, 0, "batch"}, Boxes::kBoxB)));
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        kOp, &map_d, call.out_data,
        ffi_util::output_spec(call.out, {p.n, 1, "n"}, {p.k, p.n, "k"},
                              {segments, p.k * p.n, "groups"}, {1, 0, "split"},
                              Tile::kEpilogueRowBytes, Tile::kEpilogueRows)));
    call.args.shape.m = static_cast<int>(p.k);
    call.args.shape.k = 0;
    call.args.shape.a_stage_bytes = Boxes::a_stage_bytes(Boxes::kABoxMN);
    call.ragged.templates[0] = &map_a;
    call.ragged.templates[1] = &map_b;
    call.ragged.bases[0] = x;
    call.ragged.bases[1] = w;
    call.ragged.row_bytes[0] = p.k * in_bytes;
    call.ragged.row_bytes[1] = p.n * in_bytes;
  }
  call.args.shape.n = static_cast<int>(p.n);
  call.args.tmap_a = &map_a;
  call.args.tmap_b = &map_b;
  call.args.tmap_d = &map_d;
  call.args.d = call.out_data;
  const cudaError_t launched = call.in == DType::kBF16
                                   ? launch_out<__nv_bfloat16, Tile, Layout, kMode>(call)
                                   : launch_out<__half, Tile, Layout, kMode>(call);
  return ffi_util::cuda_error(launched, "jax_tma ragged_dot launch");
}

// Each kernel's variant is its mode, as a type.
#define JAX_TMA_KERNEL(TILE, LAYOUT, MODE) \
  ffi_util::Kernel<sm90_gemm::TILE, sm90_gemm::LAYOUT, std::integral_constant<RaggedMode, MODE>>,
using Kernels = ffi_util::KernelList<JAX_TMA_SM90_RAGGED_KERNELS(JAX_TMA_KERNEL) void>;
#undef JAX_TMA_KERNEL

ffi::Error dispatch(const RaggedAttrs& p, const Call& call) {
  const auto mode = static_cast<RaggedMode>(p.mode);
  const bool w_k_major = p.w_k_major != 0;
  return ffi_util::dispatch(
      Kernels{}, p,
      [&](auto kernel) {
        using K = decltype(kernel);
        constexpr RaggedMode kMode = K::Variant::value;
        return mode == kMode && (kMode == RaggedMode::kContraction ||
                                 (K::Layout::kB == Major::kK) == w_k_major);
      },
      [&](auto kernel) {
        using K = decltype(kernel);
        return run<typename K::Tile, typename K::Layout, K::Variant::value>(p, call);
      },
      [&] { return ffi_util::no_configuration(kOp, p); });
}

// The handlers' implementation (the binding follows from its parameters: ffi/dispatch.h).
ffi::Error ragged_dot_sm90(cudaStream_t stream, int32_t device,
                           ffi::AnyBuffer x,                       // bf16 or fp16
                           ffi::AnyBuffer w,                       // w (rows) or dy (contraction)
                           ffi::AnyBuffer group_sizes,             // int32
                           ffi::Result<ffi::AnyBuffer> out,        // out
                           ffi::Result<ffi::AnyBuffer> workspace,  // ragged_workspace_bytes
                           RaggedAttrs p) {
  const std::string dims = "rows=" + str(p.rows) + ", n=" + str(p.n) + ", k=" + str(p.k) +
                           ", groups=" + str(p.groups) + ", batch=" + str(p.batch);
  if (p.mode != 0 && p.mode != 1) {
    return ffi::Error::InvalidArgument("jax_tma ragged_dot: mode must be 0 (rows) or 1 "
                                       "(contraction), got " + str(p.mode));
  }
  const auto mode = static_cast<RaggedMode>(p.mode);
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sizes(kOp, "rows, n, k, groups and batch",
                                                {p.rows, p.n, p.k, p.groups, p.batch}, 31, dims));
  if (p.batch * p.rows > INT32_MAX || p.batch * p.groups > INT32_MAX / 2) {
    return ffi::Error::InvalidArgument(
        "jax_tma ragged_dot: batch x rows and batch x groups must fit in int32, got " + dims);
  }
  Call call{};
  DType in_w;
  if (!ffi_util::to_dtype(x.element_type(), &call.in) ||
      !ffi_util::to_dtype(w.element_type(), &in_w) || call.in != in_w ||
      call.in == DType::kF32 || !ffi_util::to_dtype(out->element_type(), &call.out) ||
      (call.out != call.in && call.out != DType::kF32)) {
    return ffi::Error::InvalidArgument(
        "jax_tma ragged_dot: both operands must be bf16 or both fp16, and out their type or "
        "fp32");
  }
  if (group_sizes.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument("jax_tma ragged_dot: group_sizes must be int32");
  }
  const bool rows_mode = mode == RaggedMode::kRows;
  const int64_t weights = p.weights_batched ? p.batch * p.groups : p.groups;
  const int64_t w_rows = rows_mode ? weights * (p.w_k_major ? p.n : p.k) : p.batch * p.rows;
  const int64_t w_cols = rows_mode ? (p.w_k_major ? p.k : p.n) : p.n;
  const int64_t out_elems =
      rows_mode ? p.batch * p.rows * p.n : p.batch * p.groups * p.k * p.n;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      kOp,
      {{"x", p.batch * p.rows * p.k, x.element_count()},
       {rows_mode ? "w" : "dy", w_rows * w_cols, w.element_count()},
       {"group_sizes", (p.group_sizes_batched ? p.batch : 1) * p.groups,
        group_sizes.element_count()},
       {"out", out_elems, out->element_count()}},
      dims));
  const int64_t need_workspace = sm90_gemm::ragged_workspace_bytes(mode, p.groups, p.batch);
  if (static_cast<int64_t>(workspace->size_bytes()) < need_workspace) {
    return ffi::Error::InvalidArgument("jax_tma ragged_dot: the workspace holds " +
                                       std::to_string(workspace->size_bytes()) +
                                       " bytes, the call needs " + str(need_workspace));
  }
  const int64_t in_bytes = sm90_gemm::dtype_bytes(call.in);
  const int64_t out_bytes = sm90_gemm::dtype_bytes(call.out);
  if ((p.k * in_bytes) % 16 || (p.n * in_bytes) % 16 || (p.n * out_bytes) % 16) {
    return ffi::Error::InvalidArgument(
        "jax_tma ragged_dot: TMA needs rows of 16-byte multiples: k and n must be multiples of 8 "
        "(" + dims + ")");
  }
  const ffi_util::DeviceInfo* info = nullptr;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sm90_device(kOp, device, &info));
  call.x = &x;
  call.w = &w;
  call.out_data = out->untyped_data();
  call.args.shape.batch = 1;
  call.args.shape.splits = 1;
  call.args.num_sms = info->num_sms;
  call.args.stream = stream;
  call.ragged.mode = mode;
  call.ragged.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  call.ragged.group_sizes_batched = p.group_sizes_batched != 0;
  call.ragged.weights_batched = p.weights_batched != 0;
  call.ragged.groups = static_cast<int>(p.groups);
  call.ragged.batch = static_cast<int>(p.batch);
  call.ragged.rows = static_cast<int>(p.rows);
  call.ragged.workspace = workspace->untyped_data();
  return dispatch(p, call);
}

}  // namespace
}  // namespace jax_tma::ffi_handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::RaggedAttrs,
    xla::ffi::StructMember<int64_t>("mode"),                 // 0 rows, 1 contraction
    xla::ffi::StructMember<int64_t>("block_m"),              // tile M
    xla::ffi::StructMember<int64_t>("block_n"),              // tile N
    xla::ffi::StructMember<int64_t>("stages"),               // pipeline depth
    xla::ffi::StructMember<int64_t>("cluster_m"),            // CTAs per cluster
    xla::ffi::StructMember<int64_t>("rows"),                 // rows per batch entry (M)
    xla::ffi::StructMember<int64_t>("n"),                    // columns of w / dy
    xla::ffi::StructMember<int64_t>("k"),                    // columns of x
    xla::ffi::StructMember<int64_t>("groups"),               // groups per batch entry
    xla::ffi::StructMember<int64_t>("batch"),                // batch entries
    xla::ffi::StructMember<int64_t>("weights_batched"),      // w has batch x groups matrices
    xla::ffi::StructMember<int64_t>("group_sizes_batched"),  // group_sizes has batch rows
    xla::ffi::StructMember<int64_t>("w_k_major"));           // w stored [.., n, k]

namespace jax_tma::ffi_handlers {

// RaggedDotSm90Into takes out_in after group_sizes, aliased to out.
JAX_TMA_DEFINE_HANDLER_PAIR(RaggedDotSm90, RaggedDotSm90Into, ragged_dot_sm90, 1);

}  // namespace jax_tma::ffi_handlers
