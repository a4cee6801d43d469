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
//
// The gated rows mode (jax_tma_gated_ragged_dot_sm90), the same checks and maps with a second
// weight operand and the gated epilogue:
//   x [batch, rows, k], w_gate and w_up [groups or batch x groups, k, n] (N-major),
//   group_sizes as above -> out [batch, rows, n] = act(x @ w_gate) * (x @ w_up) per group,
//   pre (store_pre; else [1]) [2, batch, rows, n]: the gate's and the up's pre-activations,
//   workspace (ragged_workspace_bytes with three maps per segment). out and pre are the inputs'
//   type; activation: 2 gelu (tanh), 3 gelu (erf), 4 silu (epilogue/fusion.h).
//
// The gated gradient rows mode (jax_tma_gated_ragged_grad_sm90), the rows mode's checks and
// maps with the gated gradient's epilogue (gated_ragged_mlp's backward):
//   dy [batch, rows, k], w_down [groups or batch x groups, n, k] (K-major), group_sizes as above,
//   pre [2, batch, rows, n]: the gate's and the up's saved pre-activations
//   -> d_gate and d_up [batch, rows, n]: with dh = dy @ w_down^T per group, dh * up * act'(gate)
//   and dh * act(gate) (rows past the last group zero), workspace (ragged_workspace_bytes with
//   four maps per segment). One type, bf16 or fp16, for all; activation: 2 gelu (tanh), 4 silu.
//
// The FP8 rows mode (jax_tma_fp8_ragged_dot_sm90, contract/sm90_fp8_ragged_dot.h), the rows
// mode's checks and maps with FP8 operands and the FP8 product's scales:
//   x [batch, rows, k] e4m3, w [groups or batch x groups, n, k] (K-major) x's type,
//   group_sizes as above, sa [ceil(k / 128), sa_ld] fp32 (has_sa: x's block scales over the
//   stacked rows, sa_ld >= batch x rows), sb [weights, ceil(k / 128), sb_ld] fp32 (has_sb: w's
//   block scales, sb_ld >= ceil(n / 128)), row_scale and col_scale [1] fp32 (per-tensor scales,
//   1 where absent; absent ones and absent block scales are [1] placeholders)
//   -> out [batch, rows, n] bf16 or fp32, workspace (one map per segment). k is a multiple of
//   16, n of 8 (4 with fp32 out), sa_ld and sb_ld of 4.
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
#include "contract/sm90_fp8_ragged_dot.h"
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

struct GatedRaggedAttrs {
  int64_t activation, store_pre, block_m, block_n, stages, cluster_m;
  int64_t rows, n, k, groups, batch;
  int64_t weights_batched, group_sizes_batched;
};

struct GatedRaggedGradAttrs {
  int64_t activation, block_m, block_n, stages, cluster_m;
  int64_t rows, n, k, groups, batch;
  int64_t weights_batched, group_sizes_batched;
};

struct Fp8RaggedAttrs {
  int64_t block_m, block_n, stages, cluster_m;
  int64_t rows, n, k, groups, batch;
  int64_t weights_batched, group_sizes_batched;
  int64_t sa_ld, sb_ld, has_sa, has_sb, row_scale, col_scale;
};

namespace {

constexpr char kOp[] = "jax_tma ragged_dot";  // every message's prefix
constexpr char kGatedOp[] = "jax_tma gated_ragged_dot";  // the gated handler's
constexpr char kGatedTypes[] = "x, the weights, out and pre must share one type, bf16 or fp16";
constexpr char kGatedGradOp[] = "jax_tma gated_ragged_mlp backward";  // the gated gradient's
constexpr char kGatedGradTypes[] =
    "dy, w_down, pre, d_gate and d_up must share one type, bf16 or fp16";
constexpr char kFp8Op[] = "jax_tma fp8_ragged_dot";  // the FP8 handler's
constexpr char kFp8Types[] =
    "x and w must both be float8_e4m3fn or both float8_e5m2, and out bf16 or fp32";
constexpr int64_t kScaleBlock = 128;  // K (and w's N) indices per FP8 block scale

// The types a handler takes: 16-bit operands and out their type or fp32 (ragged_dot), out their
// type (gated and its gradient), FP8 operands and out bf16 or fp32 (fp8).
enum class Types { kRagged, kGated, kGatedGrad, kFp8 };

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
  const ffi::AnyBuffer* w;  // rows mode: the weights (gated: the gate's); contraction mode: dy
  void* out_data;
  LaunchArgs args;
  RaggedArgs ragged;
};

// Work units of the rows mode's schedule over `acc_n` accumulator columns.
// NOTE: each segment's row blocks round up once, and the numbering pads at most two blocks per
// batch entry and one at the end: stacked / block_m + segments + 2 batch + 1.
template <class Tile>
int64_t rows_units(const RaggedAttrs& p, int64_t acc_n) {
  const int64_t segments = sm90_gemm::ragged_segments(RaggedMode::kRows, p.groups, p.batch);
  const int64_t n_blocks = (acc_n + Tile::kBlockN - 1) / Tile::kBlockN;
  return (p.batch * p.rows / Tile::kBlockM + segments + 2 * p.batch + 1) * n_blocks;
}

// The weights' map of the rows mode: one matrix per weight (batch coordinate), N- or K-major.
template <class Tile, class Layout>
ffi_util::TensorMapSpec weights_spec(const RaggedAttrs& p, DType in) {
  using Boxes = sm90_gemm::OperandBoxes<Tile, Layout>;
  const int64_t weights = p.weights_batched ? p.batch * p.groups : p.groups;
  const ViewDim w_n = Layout::kB == Major::kK ? ViewDim{p.n, p.k, "n"} : ViewDim{p.n, 1, "n"};
  const ViewDim w_k = Layout::kB == Major::kK ? ViewDim{p.k, 1, "k"} : ViewDim{p.k, p.n, "k"};
  return ffi_util::operand_spec<Layout::kB>(in, w_n, w_k, {weights, p.k * p.n, "groups"},
                                            Boxes::kBoxB);
}

// The stacked [batch x rows, n] output rows of `data` as the epilogue stores them (rows mode:
// the template the prepare kernel moves and cuts per segment), in boxes of `box_rows` rows.
template <class Tile>
ffi_util::TensorMapSpec rows_output_spec(const RaggedAttrs& p, DType out,
                                         int box_rows = Tile::kEpilogueRows) {
  return ffi_util::output_spec(out, {p.n, 1, "n"}, {p.batch * p.rows, p.n, "rows"},
                               {1, 0, "batch"}, {1, 0, "split"}, Tile::kEpilogueRowBytes,
                               box_rows);
}

// Rows mode: A (the stacked rows, K-major), B (the weights `w`) and D's template (`out_data`),
// and the launch shape they imply (N: the weights' columns).
template <class Tile, class Layout>
ffi::Error encode_rows_maps(const char* op, const RaggedAttrs& p, Call* call, CUtensorMap* a,
                            CUtensorMap* b, CUtensorMap* d) {
  using Boxes = sm90_gemm::OperandBoxes<Tile, Layout>;
  const int64_t stacked = p.batch * p.rows;
  const int box_a[3] = {Boxes::kBoxA[0], Boxes::a_rows(stacked), 1};
  call->args.shape.a_stage_bytes = Boxes::a_stage_bytes(stacked);
  JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
      op, a, call->x->untyped_data(),
      ffi_util::operand_spec<Major::kK>(call->in, {stacked, p.k, "rows"}, {p.k, 1, "k"},
                                        {1, 0, "batch"}, box_a)));
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::encode(op, b, call->w->untyped_data(), weights_spec<Tile, Layout>(p, call->in)));
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::encode(op, d, call->out_data, rows_output_spec<Tile>(p, call->out)));
  call->args.shape.m = static_cast<int>(stacked);
  call->args.shape.k = static_cast<int>(p.k);
  call->args.shape.n = static_cast<int>(p.n);
  call->args.tmap_a = a;
  call->args.tmap_b = b;
  call->args.tmap_d = d;
  call->args.d = call->out_data;
  return ffi::Error::Success();
}

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
  const int64_t segments = sm90_gemm::ragged_segments(kMode, p.groups, p.batch);
  const int64_t n_blocks = (p.n + Tile::kBlockN - 1) / Tile::kBlockN;
  const int64_t units = kRows ? rows_units<Tile>(p, p.n)
                              : (p.k + Tile::kBlockM - 1) / Tile::kBlockM * n_blocks * segments;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_work_units(kOp, units, "up to "));
  const int in_bytes = sm90_gemm::dtype_bytes(call.in);
  const int out_bytes = sm90_gemm::dtype_bytes(call.out);
  CUtensorMap map_a, map_b, map_d;
  void* x = call.x->untyped_data();
  void* w = call.w->untyped_data();
  if constexpr (kRows) {
    JAX_TMA_RETURN_IF_ERROR((encode_rows_maps<Tile, Layout>(kOp, p, &call, &map_a, &map_b,
                                                            &map_d)));
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
    call.args.shape.n = static_cast<int>(p.n);
    call.args.tmap_a = &map_a;
    call.args.tmap_b = &map_b;
    call.args.tmap_d = &map_d;
    call.args.d = call.out_data;
  }
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

// Whether x, w and out are of the types `types` names (setting call->in and call->out).
bool check_types(Types types, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                 const ffi::AnyBuffer& out, Call* call) {
  DType in_w;
  if (!ffi_util::to_dtype(out.element_type(), &call->out)) return false;
  if (types == Types::kFp8) {
    return ffi_util::to_fp8_dtype(x.element_type(), &call->in) &&
           ffi_util::to_fp8_dtype(w.element_type(), &in_w) && call->in == in_w &&
           (call->out == DType::kBF16 || call->out == DType::kF32);
  }
  return ffi_util::to_dtype(x.element_type(), &call->in) &&
         ffi_util::to_dtype(w.element_type(), &in_w) && call->in == in_w &&
         call->in != DType::kF32 &&
         (call->out == call->in || (types == Types::kRagged && call->out == DType::kF32));
}

// The checks every handler makes (messages prefixed with `op`), and the call they describe:
// sizes, types (`types`), the element counts of x, w, group_sizes and out, a workspace with
// `maps_per_segment` maps per segment, TMA's 16-byte rows and the device.
ffi::Error check_call(const char* op, int32_t device, const ffi::AnyBuffer& x,
                      const ffi::AnyBuffer& w, const ffi::AnyBuffer& group_sizes,
                      ffi::AnyBuffer& out, ffi::AnyBuffer& workspace, const RaggedAttrs& p,
                      Types types, int maps_per_segment, cudaStream_t stream, Call* call) {
  const std::string prefix = std::string(op) + ": ";
  const std::string dims = "rows=" + str(p.rows) + ", n=" + str(p.n) + ", k=" + str(p.k) +
                           ", groups=" + str(p.groups) + ", batch=" + str(p.batch);
  if (p.mode != 0 && p.mode != 1) {
    return ffi::Error::InvalidArgument(prefix + "mode must be 0 (rows) or 1 (contraction), got " +
                                       str(p.mode));
  }
  const auto mode = static_cast<RaggedMode>(p.mode);
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sizes(op, "rows, n, k, groups and batch",
                                                {p.rows, p.n, p.k, p.groups, p.batch}, 31, dims));
  if (p.batch * p.rows > INT32_MAX || p.batch * p.groups > INT32_MAX / 2) {
    return ffi::Error::InvalidArgument(
        prefix + "batch x rows and batch x groups must fit in int32, got " + dims);
  }
  if (!check_types(types, x, w, out, call)) {
    return ffi::Error::InvalidArgument(
        prefix + (types == Types::kRagged
                      ? "both operands must be bf16 or both fp16, and out their type or fp32"
                  : types == Types::kGated     ? kGatedTypes
                  : types == Types::kGatedGrad ? kGatedGradTypes
                                               : kFp8Types));
  }
  if (group_sizes.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument(prefix + "group_sizes must be int32");
  }
  const bool rows_mode = mode == RaggedMode::kRows;
  const int64_t weights = p.weights_batched ? p.batch * p.groups : p.groups;
  const int64_t w_rows = rows_mode ? weights * (p.w_k_major ? p.n : p.k) : p.batch * p.rows;
  const int64_t w_cols = rows_mode ? (p.w_k_major ? p.k : p.n) : p.n;
  const int64_t out_elems =
      rows_mode ? p.batch * p.rows * p.n : p.batch * p.groups * p.k * p.n;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      op,
      {{types == Types::kGatedGrad ? "dy" : "x", p.batch * p.rows * p.k, x.element_count()},
       {rows_mode ? (types == Types::kGated       ? "w_gate"
                     : types == Types::kGatedGrad ? "w_down"
                                                  : "w")
                  : "dy",
        w_rows * w_cols, w.element_count()},
       {"group_sizes", (p.group_sizes_batched ? p.batch : 1) * p.groups,
        group_sizes.element_count()},
       {types == Types::kGatedGrad ? "d_gate" : "out", out_elems, out.element_count()}},
      dims));
  const int64_t need_workspace =
      sm90_gemm::ragged_workspace_bytes(mode, p.groups, p.batch, maps_per_segment);
  if (static_cast<int64_t>(workspace.size_bytes()) < need_workspace) {
    return ffi::Error::InvalidArgument(prefix + "the workspace holds " +
                                       std::to_string(workspace.size_bytes()) +
                                       " bytes, the call needs " + str(need_workspace));
  }
  const int64_t in_bytes = sm90_gemm::dtype_bytes(call->in);
  const int64_t out_bytes = sm90_gemm::dtype_bytes(call->out);
  if (types == Types::kFp8) {  // (w is K-major: its rows are k bytes)
    if (p.k % 16 || (p.n * out_bytes) % 16) {
      return ffi::Error::InvalidArgument(
          prefix + "TMA needs rows of 16-byte multiples: k must be a multiple of 16 and n of " +
          str(16 / out_bytes) + " (" + dims + ")");
    }
  } else if ((p.k * in_bytes) % 16 || (p.n * in_bytes) % 16 || (p.n * out_bytes) % 16) {
    return ffi::Error::InvalidArgument(
        prefix + "TMA needs rows of 16-byte multiples: k and n must be multiples of 8 (" + dims +
        ")");
  }
  const ffi_util::DeviceInfo* info = nullptr;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sm90_device(op, device, &info));
  call->x = &x;
  call->w = &w;
  call->out_data = out.untyped_data();
  call->args.shape.batch = 1;
  call->args.shape.splits = 1;
  call->args.num_sms = info->num_sms;
  call->args.stream = stream;
  call->ragged.mode = mode;
  call->ragged.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  call->ragged.group_sizes_batched = p.group_sizes_batched != 0;
  call->ragged.weights_batched = p.weights_batched != 0;
  call->ragged.groups = static_cast<int>(p.groups);
  call->ragged.batch = static_cast<int>(p.batch);
  call->ragged.rows = static_cast<int>(p.rows);
  call->ragged.workspace = workspace.untyped_data();
  return ffi::Error::Success();
}

// The handlers' implementation (the binding follows from its parameters: ffi/dispatch.h).
ffi::Error ragged_dot_sm90(cudaStream_t stream, int32_t device,
                           ffi::AnyBuffer x,                       // bf16 or fp16
                           ffi::AnyBuffer w,                       // w (rows) or dy (contraction)
                           ffi::AnyBuffer group_sizes,             // int32
                           ffi::Result<ffi::AnyBuffer> out,        // out
                           ffi::Result<ffi::AnyBuffer> workspace,  // ragged_workspace_bytes
                           RaggedAttrs p) {
  Call call{};
  const int maps = sm90_gemm::ragged_maps_per_segment(static_cast<RaggedMode>(p.mode));
  JAX_TMA_RETURN_IF_ERROR(
      check_call(kOp, device, x, w, group_sizes, *out, *workspace, p, Types::kRagged, maps,
                 stream, &call));
  return dispatch(p, call);
}

// ---------------------------------------------------------------- the gated rows mode


// The rows mode's attributes of a gated call (its weights N-major, its n the output's columns).
RaggedAttrs rows_attrs(const GatedRaggedAttrs& g) {
  return RaggedAttrs{0,        g.block_m, g.block_n,         g.stages,
                     g.cluster_m, g.rows, g.n,               g.k,
                     g.groups, g.batch,   g.weights_batched, g.group_sizes_batched,
                     0};
}

template <class Tile, class Layout, class Fusion>
ffi::Error run_gated(const GatedRaggedAttrs& g, Call call, const ffi::AnyBuffer& up,
                     void* pre_data) {
  const RaggedAttrs p = rows_attrs(g);
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::check_work_units(kGatedOp, rows_units<Tile>(p, 2 * p.n), "up to "));
  CUtensorMap map_a, map_b, map_d, map_up, map_gate_pre, map_up_pre;
  JAX_TMA_RETURN_IF_ERROR((encode_rows_maps<Tile, Layout>(kGatedOp, p, &call, &map_a, &map_b,
                                                          &map_d)));
  JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kGatedOp, &map_up, up.untyped_data(),
                                           weights_spec<Tile, Layout>(p, call.in)));
  // The accumulator holds the gate's and the up's columns.
  call.args.shape.n = static_cast<int>(2 * p.n);
  // Per segment: D's map, then (store_pre) the gate's and the up's pre-activations', cut like
  // D's; without them the last two are D's again (never used).
  const int64_t row_bytes = p.n * sm90_gemm::dtype_bytes(call.out);
  const CUtensorMap* templates[3] = {&map_d, &map_d, &map_d};
  const void* bases[3] = {call.out_data, call.out_data, call.out_data};
  if (g.store_pre) {
    auto* up_pre = static_cast<uint8_t*>(pre_data) + p.batch * p.rows * row_bytes;
    const auto spec = rows_output_spec<Tile>(p, call.out);
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kGatedOp, &map_gate_pre, pre_data, spec));
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kGatedOp, &map_up_pre, up_pre, spec));
    templates[1] = &map_gate_pre;
    templates[2] = &map_up_pre;
    bases[1] = pre_data;
    bases[2] = up_pre;
  }
  for (int i = 0; i < 3; ++i) {
    call.ragged.templates[i] = templates[i];
    call.ragged.bases[i] = bases[i];
    call.ragged.row_bytes[i] = row_bytes;
  }
  const bool store_pre = g.store_pre != 0;
  const cudaError_t launched =
      call.in == DType::kBF16
          ? sm90_gemm::launch_ragged_gated<__nv_bfloat16, Tile, Layout, Fusion>(
                call.args, call.ragged, map_up, store_pre)
          : sm90_gemm::launch_ragged_gated<__half, Tile, Layout, Fusion>(
                call.args, call.ragged, map_up, store_pre);
  return ffi_util::cuda_error(launched, "jax_tma gated_ragged_dot launch");
}

#define JAX_TMA_KERNEL(TILE, LAYOUT, FUSION) \
  ffi_util::Kernel<sm90_gemm::TILE, sm90_gemm::LAYOUT, sm90_gemm::FUSION>,
using GatedKernels = ffi_util::KernelList<JAX_TMA_SM90_RAGGED_GATED_KERNELS(JAX_TMA_KERNEL) void>;
#undef JAX_TMA_KERNEL

ffi::Error gated_ragged_dot_sm90(cudaStream_t stream, int32_t device,
                                 ffi::AnyBuffer x,                       // bf16 or fp16
                                 ffi::AnyBuffer w_gate,                  // [.., k, n]
                                 ffi::AnyBuffer w_up,                    // [.., k, n]
                                 ffi::AnyBuffer group_sizes,             // int32
                                 ffi::Result<ffi::AnyBuffer> out,        // out
                                 ffi::Result<ffi::AnyBuffer> pre,        // pre-activations
                                 ffi::Result<ffi::AnyBuffer> workspace,  // three maps a segment
                                 GatedRaggedAttrs g) {
  const RaggedAttrs p = rows_attrs(g);
  Call call{};
  JAX_TMA_RETURN_IF_ERROR(check_call(kGatedOp, device, x, w_gate, group_sizes, *out,
                                     *workspace, p, Types::kGated,
                                     sm90_gemm::kRaggedGatedMapsPerSegment, stream, &call));
  const std::string dims = "rows=" + str(p.rows) + ", n=" + str(p.n) + ", k=" + str(p.k) +
                           ", groups=" + str(p.groups) + ", batch=" + str(p.batch);
  DType up_type, pre_type;
  if (!ffi_util::to_dtype(w_up.element_type(), &up_type) || up_type != call.in ||
      !ffi_util::to_dtype(pre->element_type(), &pre_type) || pre_type != call.in) {
    return ffi::Error::InvalidArgument(std::string(kGatedOp) + ": " + kGatedTypes);
  }
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      kGatedOp,
      {{"w_up", static_cast<int64_t>(w_gate.element_count()), w_up.element_count()},
       {"pre", g.store_pre ? 2 * p.batch * p.rows * p.n : 1, pre->element_count()}},
      dims));
  return ffi_util::dispatch(
      GatedKernels{}, g,
      [&](auto kernel) {
        return g.activation == static_cast<int64_t>(decltype(kernel)::Variant::kAct);
      },
      [&](auto kernel) {
        using K = decltype(kernel);
        return run_gated<typename K::Tile, typename K::Layout, typename K::Variant>(
            g, call, w_up, pre->untyped_data());
      },
      [&] {
        return ffi_util::no_configuration(kGatedOp, g,
                                          ", activation=" + str(g.activation));
      });
}

// ---------------------------------------------------------------- the gated gradient rows mode


// The rows mode's attributes of a gated gradient call (w_down K-major, its n the cotangents'
// columns F, its k dy's D).
RaggedAttrs rows_attrs(const GatedRaggedGradAttrs& a) {
  return RaggedAttrs{0,        a.block_m, a.block_n,         a.stages,
                     a.cluster_m, a.rows, a.n,               a.k,
                     a.groups, a.batch,   a.weights_batched, a.group_sizes_batched,
                     1};
}

template <class Tile, class Layout, class Fusion>
ffi::Error run_gated_grad(const GatedRaggedGradAttrs& a, Call call, const void* pre_data,
                          void* d_up_data) {
  const RaggedAttrs p = rows_attrs(a);
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::check_work_units(kGatedGradOp, rows_units<Tile>(p, p.n), "up to "));
  CUtensorMap map_a, map_b, map_d, map_d_up, map_gate, map_up;
  JAX_TMA_RETURN_IF_ERROR((encode_rows_maps<Tile, Layout>(kGatedGradOp, p, &call, &map_a,
                                                          &map_b, &map_d)));
  // Per segment: D's map (the gate's cotangent), then the up's cotangent's and the two
  // pre-activations', cut like D's, in boxes of half its rows (the epilogue warps move them half
  // a chunk at a time: epilogue/epilogue_warps.cuh).
  const int64_t row_bytes = p.n * sm90_gemm::dtype_bytes(call.out);
  const auto half = rows_output_spec<Tile>(p, call.out, Tile::kEpilogueRows / 2);
  const auto* gate = static_cast<const uint8_t*>(pre_data);
  const uint8_t* up = gate + p.batch * p.rows * row_bytes;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kGatedGradOp, &map_d_up, d_up_data, half));
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::encode(kGatedGradOp, &map_gate, const_cast<uint8_t*>(gate), half));
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::encode(kGatedGradOp, &map_up, const_cast<uint8_t*>(up), half));
  const CUtensorMap* templates[4] = {&map_d, &map_d_up, &map_gate, &map_up};
  const void* bases[4] = {call.out_data, d_up_data, gate, up};
  static_assert(sm90_gemm::kRaggedGatedGradMapsPerSegment == 4);
  for (int i = 0; i < 4; ++i) {
    call.ragged.templates[i] = templates[i];
    call.ragged.bases[i] = bases[i];
    call.ragged.row_bytes[i] = row_bytes;
  }
  const cudaError_t launched =
      call.in == DType::kBF16
          ? sm90_gemm::launch_ragged_gated_grad<__nv_bfloat16, Tile, Layout, Fusion>(
                call.args, call.ragged)
          : sm90_gemm::launch_ragged_gated_grad<__half, Tile, Layout, Fusion>(call.args,
                                                                              call.ragged);
  return ffi_util::cuda_error(launched, "jax_tma gated_ragged_mlp backward launch");
}

#define JAX_TMA_KERNEL(TILE, LAYOUT, FUSION) \
  ffi_util::Kernel<sm90_gemm::TILE, sm90_gemm::LAYOUT, sm90_gemm::FUSION>,
using GatedGradKernels =
    ffi_util::KernelList<JAX_TMA_SM90_RAGGED_GATED_GRAD_KERNELS(JAX_TMA_KERNEL) void>;
#undef JAX_TMA_KERNEL

ffi::Error gated_ragged_grad_sm90(cudaStream_t stream, int32_t device,
                                  ffi::AnyBuffer dy,                      // bf16 or fp16
                                  ffi::AnyBuffer w_down,                  // [.., n, k]
                                  ffi::AnyBuffer group_sizes,             // int32
                                  ffi::AnyBuffer pre,                     // [2, .., n]
                                  ffi::Result<ffi::AnyBuffer> d_gate,     // [batch, rows, n]
                                  ffi::Result<ffi::AnyBuffer> d_up,       // [batch, rows, n]
                                  ffi::Result<ffi::AnyBuffer> workspace,  // four maps a segment
                                  GatedRaggedGradAttrs a) {
  const RaggedAttrs p = rows_attrs(a);
  Call call{};
  JAX_TMA_RETURN_IF_ERROR(check_call(kGatedGradOp, device, dy, w_down, group_sizes, *d_gate,
                                     *workspace, p, Types::kGatedGrad,
                                     sm90_gemm::kRaggedGatedGradMapsPerSegment, stream, &call));
  const std::string dims = "rows=" + str(p.rows) + ", n=" + str(p.n) + ", k=" + str(p.k) +
                           ", groups=" + str(p.groups) + ", batch=" + str(p.batch);
  DType pre_type, d_up_type;
  if (!ffi_util::to_dtype(pre.element_type(), &pre_type) || pre_type != call.in ||
      !ffi_util::to_dtype(d_up->element_type(), &d_up_type) || d_up_type != call.in) {
    return ffi::Error::InvalidArgument(std::string(kGatedGradOp) + ": " + kGatedGradTypes);
  }
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      kGatedGradOp,
      {{"pre", 2 * p.batch * p.rows * p.n, pre.element_count()},
       {"d_up", p.batch * p.rows * p.n, d_up->element_count()}},
      dims));
  return ffi_util::dispatch(
      GatedGradKernels{}, a,
      [&](auto kernel) {
        return a.activation == static_cast<int64_t>(decltype(kernel)::Variant::kAct);
      },
      [&](auto kernel) {
        using K = decltype(kernel);
        return run_gated_grad<typename K::Tile, typename K::Layout, typename K::Variant>(
            a, call, pre.untyped_data(), d_up->untyped_data());
      },
      [&] {
        return ffi_util::no_configuration(kGatedGradOp, a, ", activation=" + str(a.activation));
      });
}

// ---------------------------------------------------------------- the FP8 rows mode


// The rows mode's attributes of an FP8 call (its weights K-major).
RaggedAttrs rows_attrs(const Fp8RaggedAttrs& f) {
  return RaggedAttrs{0,        f.block_m, f.block_n,         f.stages,
                     f.cluster_m, f.rows, f.n,               f.k,
                     f.groups, f.batch,   f.weights_batched, f.group_sizes_batched,
                     1};
}

// The FP8 call's scales: block scales (null where absent) and per-tensor ones (null where
// absent).
struct Fp8Scales {
  const ffi::AnyBuffer* sa;
  const ffi::AnyBuffer* sb;
  const ffi::AnyBuffer* row_scale;
  const ffi::AnyBuffer* col_scale;
};

template <class Tile>
ffi::Error run_fp8(const Fp8RaggedAttrs& f, Call call, const Fp8Scales& scales) {
  using Layout = sm90_gemm::LayoutNT;
  const RaggedAttrs p = rows_attrs(f);
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::check_work_units(kFp8Op, rows_units<Tile>(p, p.n), "up to "));
  CUtensorMap map_a, map_b, map_d, map_sa = {}, map_sb = {};
  JAX_TMA_RETURN_IF_ERROR(
      (encode_rows_maps<Tile, Layout>(kFp8Op, p, &call, &map_a, &map_b, &map_d)));
  call.ragged.templates[0] = &map_d;
  call.ragged.bases[0] = call.out_data;
  call.ragged.row_bytes[0] = p.n * sm90_gemm::dtype_bytes(call.out);
  // One map of A's scales over the stacked rows (tiles read them at absolute rows, as A's, in
  // boxes from the 4-aligned row at or before the tile's first: a group starts at any row), and
  // B's over the weights (batch coordinate: the segment's weight, as B's).
  const int64_t kb = (p.k + kScaleBlock - 1) / kScaleBlock;
  const int64_t nb = (p.n + kScaleBlock - 1) / kScaleBlock;
  const int64_t weights = p.weights_batched ? p.batch * p.groups : p.groups;
  if (scales.sa != nullptr) {
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        std::string(kFp8Op) + ", sa", &map_sa, scales.sa->untyped_data(),
        ffi_util::block_scale_spec({p.batch * p.rows, 1, "rows"}, {kb, f.sa_ld, "sa_ld"},
                                   {1, 0, "batch"}, Tile::kAScaleBoxAnyRow)));
  }
  if (scales.sb != nullptr) {
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
        std::string(kFp8Op) + ", sb", &map_sb, scales.sb->untyped_data(),
        ffi_util::block_scale_spec({nb, 1, "n / 128"}, {kb, f.sb_ld, "sb_ld"},
                                   {weights, kb * f.sb_ld, "groups"}, Tile::kBScaleBox)));
  }
  const auto scalar = [](const ffi::AnyBuffer* v) {
    return v != nullptr ? static_cast<const float*>(v->untyped_data()) : nullptr;
  };
  const sm90_gemm::Fp8Launch fp8{scales.sa != nullptr ? &map_sa : nullptr,
                                 scales.sb != nullptr ? &map_sb : nullptr,
                                 scalar(scales.row_scale),
                                 scalar(scales.col_scale),
                                 true,
                                 true,
                                 nullptr};
  const cudaError_t launched =
      call.out == DType::kF32
          ? sm90_gemm::launch_fp8_ragged<__nv_fp8_e4m3, float, Tile>(call.args, call.ragged, fp8)
          : sm90_gemm::launch_fp8_ragged<__nv_fp8_e4m3, __nv_bfloat16, Tile>(call.args,
                                                                             call.ragged, fp8);
  return ffi_util::cuda_error(launched, "jax_tma fp8_ragged_dot launch");
}

#define JAX_TMA_KERNEL(ARG, TILE) ffi_util::Kernel<sm90_gemm::TILE>,
using Fp8Kernels = ffi_util::KernelList<JAX_TMA_SM90_FP8_RAGGED_TILES(JAX_TMA_KERNEL, _) void>;
#undef JAX_TMA_KERNEL

ffi::Error fp8_ragged_dot_sm90(cudaStream_t stream, int32_t device,
                               ffi::AnyBuffer x,                       // e4m3 (e5m2: checked)
                               ffi::AnyBuffer w,                       // [.., n, k], x's type
                               ffi::AnyBuffer group_sizes,             // int32
                               ffi::AnyBuffer sa,                      // fp32 block scales of x
                               ffi::AnyBuffer sb,                      // fp32 block scales of w
                               ffi::AnyBuffer row_scale,               // fp32, one value
                               ffi::AnyBuffer col_scale,               // fp32, one value
                               ffi::Result<ffi::AnyBuffer> out,        // bf16 or fp32
                               ffi::Result<ffi::AnyBuffer> workspace,  // one map a segment
                               Fp8RaggedAttrs f) {
  const RaggedAttrs p = rows_attrs(f);
  const std::string prefix = std::string(kFp8Op) + ": ";
  const std::string dims = "rows=" + str(p.rows) + ", n=" + str(p.n) + ", k=" + str(p.k) +
                           ", groups=" + str(p.groups) + ", batch=" + str(p.batch);
  // The rows mode's checks first: they bound the sizes, so that the products below cannot
  // overflow.
  Call call{};
  JAX_TMA_RETURN_IF_ERROR(check_call(kFp8Op, device, x, w, group_sizes, *out, *workspace, p,
                                     Types::kFp8,
                                     sm90_gemm::ragged_maps_per_segment(RaggedMode::kRows),
                                     stream, &call));
  for (const int64_t flag : {f.has_sa, f.has_sb, f.row_scale, f.col_scale}) {
    if (flag != 0 && flag != 1) {
      return ffi::Error::InvalidArgument(
          prefix + "has_sa, has_sb, row_scale and col_scale must be 0 or 1, got " +
          str(f.has_sa) + ", " + str(f.has_sb) + ", " + str(f.row_scale) + ", " +
          str(f.col_scale));
    }
  }
  for (const ffi::AnyBuffer* v : {&sa, &sb, &row_scale, &col_scale}) {
    if (v->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument(prefix + "the scales must be fp32");
    }
  }
  const int64_t kb = (p.k + kScaleBlock - 1) / kScaleBlock;
  const int64_t nb = (p.n + kScaleBlock - 1) / kScaleBlock;
  const int64_t stacked = p.batch * p.rows;
  const int64_t weights = p.weights_batched ? p.batch * p.groups : p.groups;
  // (sa_ld below 2^31, and sb_ld small enough that sb's element count fits int64: weights x kb
  // is below 2^30 x 2^24)
  if ((f.has_sa && (f.sa_ld < stacked || f.sa_ld % 4 || f.sa_ld > INT32_MAX)) ||
      (f.has_sb && (f.sb_ld < nb || f.sb_ld % 4 || f.sb_ld > INT64_MAX / (weights * kb)))) {
    return ffi::Error::InvalidArgument(
        prefix + "TMA needs 16-byte rows of scales: sa_ld >= batch x rows and sb_ld >= "
                 "ceil(n / 128), each a multiple of 4 (and sa_ld below 2^31), got " + dims +
        ", sa_ld=" + str(f.sa_ld) + ", sb_ld=" + str(f.sb_ld));
  }
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      kFp8Op,
      {{"sa", f.has_sa ? kb * f.sa_ld : 1, sa.element_count()},
       {"sb", f.has_sb ? weights * kb * f.sb_ld : 1, sb.element_count()},
       {"row_scale", 1, row_scale.element_count()},
       {"col_scale", 1, col_scale.element_count()}},
      dims));
  if (call.in != DType::kF8E4M3) {
    return ffi::Error::InvalidArgument(prefix + "no kernel compiled for float8_e5m2 operands "
                                                "(jax_tma.fp8_ragged_dot runs them through XLA)");
  }
  const Fp8Scales scales{f.has_sa ? &sa : nullptr, f.has_sb ? &sb : nullptr,
                         f.row_scale ? &row_scale : nullptr, f.col_scale ? &col_scale : nullptr};
  return ffi_util::dispatch(
      Fp8Kernels{}, f, [](auto) { return true; },
      [&](auto kernel) { return run_fp8<typename decltype(kernel)::Tile>(f, call, scales); },
      [&] { return ffi_util::no_configuration(kFp8Op, f); });
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

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::GatedRaggedAttrs,
    xla::ffi::StructMember<int64_t>("activation"),           // 2 gelu tanh, 3 gelu erf, 4 silu
    xla::ffi::StructMember<int64_t>("store_pre"),            // also the pre-activations
    xla::ffi::StructMember<int64_t>("block_m"),              // tile M
    xla::ffi::StructMember<int64_t>("block_n"),              // tile N (gate and up columns)
    xla::ffi::StructMember<int64_t>("stages"),               // pipeline depth
    xla::ffi::StructMember<int64_t>("cluster_m"),            // CTAs per cluster
    xla::ffi::StructMember<int64_t>("rows"),                 // rows per batch entry (M)
    xla::ffi::StructMember<int64_t>("n"),                    // output columns (F)
    xla::ffi::StructMember<int64_t>("k"),                    // columns of x
    xla::ffi::StructMember<int64_t>("groups"),               // groups per batch entry
    xla::ffi::StructMember<int64_t>("batch"),                // batch entries
    xla::ffi::StructMember<int64_t>("weights_batched"),      // weights batch x groups matrices
    xla::ffi::StructMember<int64_t>("group_sizes_batched")); // group_sizes has batch rows

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::GatedRaggedGradAttrs,
    xla::ffi::StructMember<int64_t>("activation"),           // 2 gelu tanh, 4 silu
    xla::ffi::StructMember<int64_t>("block_m"),              // tile M
    xla::ffi::StructMember<int64_t>("block_n"),              // tile N
    xla::ffi::StructMember<int64_t>("stages"),               // pipeline depth
    xla::ffi::StructMember<int64_t>("cluster_m"),            // CTAs per cluster
    xla::ffi::StructMember<int64_t>("rows"),                 // rows per batch entry (M)
    xla::ffi::StructMember<int64_t>("n"),                    // cotangents' columns (F)
    xla::ffi::StructMember<int64_t>("k"),                    // columns of dy (D)
    xla::ffi::StructMember<int64_t>("groups"),               // groups per batch entry
    xla::ffi::StructMember<int64_t>("batch"),                // batch entries
    xla::ffi::StructMember<int64_t>("weights_batched"),      // w_down batch x groups matrices
    xla::ffi::StructMember<int64_t>("group_sizes_batched")); // group_sizes has batch rows

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::Fp8RaggedAttrs,
    xla::ffi::StructMember<int64_t>("block_m"),              // tile M
    xla::ffi::StructMember<int64_t>("block_n"),              // tile N
    xla::ffi::StructMember<int64_t>("stages"),               // pipeline depth
    xla::ffi::StructMember<int64_t>("cluster_m"),            // CTAs per cluster
    xla::ffi::StructMember<int64_t>("rows"),                 // rows per batch entry (M)
    xla::ffi::StructMember<int64_t>("n"),                    // rows of each w matrix
    xla::ffi::StructMember<int64_t>("k"),                    // columns of x and w
    xla::ffi::StructMember<int64_t>("groups"),               // groups per batch entry
    xla::ffi::StructMember<int64_t>("batch"),                // batch entries
    xla::ffi::StructMember<int64_t>("weights_batched"),      // w has batch x groups matrices
    xla::ffi::StructMember<int64_t>("group_sizes_batched"),  // group_sizes has batch rows
    xla::ffi::StructMember<int64_t>("sa_ld"),                // sa's row length (>= batch x rows)
    xla::ffi::StructMember<int64_t>("sb_ld"),                // sb's row length (>= ceil(n/128))
    xla::ffi::StructMember<int64_t>("has_sa"),               // x has block scales
    xla::ffi::StructMember<int64_t>("has_sb"),               // w has block scales
    xla::ffi::StructMember<int64_t>("row_scale"),            // x's per-tensor scale given
    xla::ffi::StructMember<int64_t>("col_scale"));           // w's per-tensor scale given

namespace jax_tma::ffi_handlers {

// RaggedDotSm90Into takes out_in after group_sizes, aliased to out.
JAX_TMA_DEFINE_HANDLER_PAIR(RaggedDotSm90, RaggedDotSm90Into, ragged_dot_sm90, 1);
// GatedRaggedDotSm90Into takes out_in and pre_in after group_sizes, aliased to out and pre.
JAX_TMA_DEFINE_HANDLER_PAIR(GatedRaggedDotSm90, GatedRaggedDotSm90Into, gated_ragged_dot_sm90,
                            2);
// GatedRaggedGradSm90Into takes d_gate_in and d_up_in after pre, aliased to d_gate and d_up.
JAX_TMA_DEFINE_HANDLER_PAIR(GatedRaggedGradSm90, GatedRaggedGradSm90Into, gated_ragged_grad_sm90,
                            2);
// Fp8RaggedDotSm90Into takes out_in after col_scale, aliased to out.
JAX_TMA_DEFINE_HANDLER_PAIR(Fp8RaggedDotSm90, Fp8RaggedDotSm90Into, fp8_ragged_dot_sm90, 1);

}  // namespace jax_tma::ffi_handlers
