// XLA FFI handler of the FP8 products on Hopper (sm_90a): argument checks, tensor maps and the
// launch of the (tile, FP8 type, output type) kernel the attributes and buffers name
// (contract/sm90_fp8.h says what is computed).
//
// Contiguous operands; optional ones are passed as 1-element placeholders:
//   a          [batch_a, m, k]          e4m3 or e5m2 (batch_a = batch if a_batched, else 1)
//   b          [batch_b, n, k]          a's type (batch_b = batch if b_batched, else 1)
//   sa         [batch_a, kb, sa_ld] fp32  has_sa: A's block scales, kb = ceil(k / 128),
//                                       sa_ld >= m
//   sb         [batch_b, kb, sb_ld] fp32  has_sb: B's block scales, sb_ld >= ceil(n / 128)
//   row_scale  [m] fp32                 row_scale = 2 ([1]: row_scale = 1, one for all rows)
//   col_scale  [n] fp32                 col_scale = 2 ([1]: col_scale = 1, one for all)
//   bias       [n] fp32                 has_bias
// -> out [splits, batch, m, n], bf16 or fp32 (fp32 when splits > 1: one partial product per K
// range, for the caller to sum), workspace (stream_k = 1: sm90_gemm::stream_k_workspace_bytes,
// flags zeroed by the launch; any size, untouched, when 0). k is a multiple of 16, n of 8, sa_ld and sb_ld of 4 (16-byte
// rows for TMA). promote = 1 runs a tile of JAX_TMA_SM90_FP8_TILES (partial sums promoted every
// 128 K), promote = 0 one of JAX_TMA_SM90_FP8_FAST_TILES (the tensor core's accumulation over
// the whole K range), which reads no block scales (contract/sm90_fp8.h). stream_k = 1 (128-row
// tiles without a cluster, no split-K) deals the last wave's K slices out to the whole grid
// (scheduler/tile_scheduler.cuh): the promoted partial sums are already scaled, so the pieces'
// sums add up as the unsplit tile's would.
#include "ffi/fp8.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/checks.h"
#include "ffi/cuda_check.h"
#include "ffi/device_info.h"
#include "ffi/dispatch.h"
#include "ffi/gemm_maps.h"
#include "ffi/tensor_map.h"
#include "contract/sm90_fp8.h"
#include "contract/sm90_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {

struct Fp8Attrs {
  int64_t block_m, block_n, stages, cluster_m, promote, splits, stream_k;
  int64_t m, n, k, batch, a_batched, b_batched, sa_ld, sb_ld;
  int64_t has_sa, has_sb, row_scale, col_scale, has_bias;
};

namespace {

constexpr char kOp[] = "jax_tma fp8";  // every message's prefix

using ffi_util::str;
using sm90_gemm::DType;
using sm90_gemm::Fp8Launch;
using sm90_gemm::LaunchArgs;
using sm90_gemm::Major;

constexpr int64_t kScaleBlock = 128;  // K (and B's N) indices per block scale

struct Buffers {
  const ffi::AnyBuffer* a;
  const ffi::AnyBuffer* b;
  const ffi::AnyBuffer* sa;
  const ffi::AnyBuffer* sb;
  const ffi::AnyBuffer* row_scale;
  const ffi::AnyBuffer* col_scale;
  const ffi::AnyBuffer* bias;
  ffi::AnyBuffer* out;
  ffi::AnyBuffer* workspace;
};

template <class T, class Tile, bool kPromote>
cudaError_t launch_out(DType out, const LaunchArgs& args, const Fp8Launch& fp8) {
  if (out == DType::kF32) return sm90_gemm::launch_fp8<T, float, Tile, kPromote>(args, fp8);
  return sm90_gemm::launch_fp8<T, __nv_bfloat16, Tile, kPromote>(args, fp8);
}

template <class Tile, bool kPromote>
ffi::Error run(const Fp8Attrs& p, DType in, DType out, const Buffers& buf, LaunchArgs args) {
  if (p.stream_k && !Tile::kStreamK) {
    return ffi::Error::InvalidArgument(
        "jax_tma fp8: stream_k=1 needs a 128-row tile without a cluster (cluster_m=1), got "
        "block_m=" + str(p.block_m) + ", cluster_m=" + str(p.cluster_m));
  }
  using Boxes = sm90_gemm::OperandBoxes<Tile, sm90_gemm::LayoutNT>;
  const int64_t units = (p.m + Tile::kBlockM - 1) / Tile::kBlockM *
                        ((p.n + Tile::kBlockN - 1) / Tile::kBlockN) * p.batch * p.splits;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_work_units(kOp, units));
  const int64_t kb = (p.k + kScaleBlock - 1) / kScaleBlock;
  const int64_t nb = (p.n + kScaleBlock - 1) / kScaleBlock;
  const int64_t batch_a = p.a_batched ? p.batch : 1;
  const int64_t batch_b = p.b_batched ? p.batch : 1;
  const int box_a[3] = {Boxes::kBoxA[0], Boxes::a_rows(p.m), 1};
  args.shape.a_stage_bytes = Boxes::a_stage_bytes(p.m);
  const auto spec_sa = ffi_util::block_scale_spec(
      {p.m, 1, "m"}, {kb, p.sa_ld, "sa_ld"}, {batch_a, kb * p.sa_ld, "batch"}, Tile::kBlockM);
  const auto spec_sb = ffi_util::block_scale_spec({nb, 1, "n / 128"}, {kb, p.sb_ld, "sb_ld"},
                                                  {batch_b, kb * p.sb_ld, "batch"},
                                                  Tile::kBScaleBox);
  CUtensorMap map_a, map_b, map_sa = {}, map_sb = {}, map_d;
  struct Map {
    const char* name;
    CUtensorMap* map;
    void* base;
    ffi_util::TensorMapSpec spec;
    bool used;
  };
  for (const Map& m : {
           Map{"a", &map_a, buf.a->untyped_data(),
               ffi_util::operand_spec<Major::kK>(in, {p.m, p.k, "m"}, {p.k, 1, "k"},
                                                 {batch_a, p.m * p.k, "batch"}, box_a),
               true},
           Map{"b", &map_b, buf.b->untyped_data(),
               ffi_util::operand_spec<Major::kK>(in, {p.n, p.k, "n"}, {p.k, 1, "k"},
                                                 {batch_b, p.n * p.k, "batch"}, Boxes::kBoxB),
               true},
           Map{"sa", &map_sa, buf.sa->untyped_data(), spec_sa, p.has_sa != 0},
           Map{"sb", &map_sb, buf.sb->untyped_data(), spec_sb, p.has_sb != 0},
           Map{"out", &map_d, buf.out->untyped_data(),
               ffi_util::output_spec(out, {p.n, 1, "n"}, {p.m, p.n, "m"},
                                     {p.batch, p.m * p.n, "batch"},
                                     {p.splits, p.batch * p.m * p.n, "split"},
                                     Tile::kEpilogueRowBytes, Tile::kEpilogueRows),
               true}}) {
    if (m.used) {
      JAX_TMA_RETURN_IF_ERROR(
          ffi_util::encode(std::string("jax_tma fp8, ") + m.name, m.map, m.base, m.spec));
    }
  }
  args.tmap_a = &map_a;
  args.tmap_b = &map_b;
  args.tmap_d = &map_d;
  args.d = buf.out->untyped_data();
  const auto vector = [](const ffi::AnyBuffer* v, int64_t present) {
    return present ? static_cast<const float*>(v->untyped_data()) : nullptr;
  };
  const Fp8Launch fp8{p.has_sa ? &map_sa : nullptr, p.has_sb ? &map_sb : nullptr,
                      vector(buf.row_scale, p.row_scale),   vector(buf.col_scale, p.col_scale),
                      p.row_scale == 1,                     p.col_scale == 1,
                      vector(buf.bias, p.has_bias)};
  const cudaError_t launched =
      in == DType::kF8E4M3 ? launch_out<__nv_fp8_e4m3, Tile, kPromote>(out, args, fp8)
                           : launch_out<__nv_fp8_e5m2, Tile, kPromote>(out, args, fp8);
  return ffi_util::cuda_error(launched, "jax_tma fp8 launch");
}

std::string describe(const Fp8Attrs& p) {
  return ffi_util::describe_tile(p) + ", promote=" + str(p.promote);
}

#define JAX_TMA_KERNEL(ARG, TILE) ffi_util::Kernel<sm90_gemm::TILE>,
using Tiles = ffi_util::KernelList<JAX_TMA_SM90_FP8_TILES(JAX_TMA_KERNEL, _) void>;
using FastTiles = ffi_util::KernelList<JAX_TMA_SM90_FP8_FAST_TILES(JAX_TMA_KERNEL, _) void>;
#undef JAX_TMA_KERNEL

// run<Tile, promote> for the compiled tile that the attributes name, in the list of the
// accumulation they ask for.
template <bool kPromote, class List>
ffi::Error dispatch_in(List list, const Fp8Attrs& p, DType in, DType out, const Buffers& buf,
                       const LaunchArgs& args) {
  return ffi_util::dispatch(
      list, p, [](auto) { return true; },
      [&](auto kernel) {
        return run<typename decltype(kernel)::Tile, kPromote>(p, in, out, buf, args);
      },
      [&] {
        return ffi::Error::InvalidArgument(std::string("jax_tma fp8: no tile compiled ") +
                                           (kPromote ? "with promotion" : "for fast accumulation") +
                                           " with " + describe(p));
      });
}

ffi::Error dispatch(const Fp8Attrs& p, DType in, DType out, const Buffers& buf,
                    const LaunchArgs& args) {
  if (p.promote) return dispatch_in<true>(Tiles{}, p, in, out, buf, args);
  return dispatch_in<false>(FastTiles{}, p, in, out, buf, args);
}

ffi::Error fp8_gemm(cudaStream_t stream, int32_t device, const Buffers& buf, const Fp8Attrs& p) {
  const std::string dims = "m=" + str(p.m) + ", n=" + str(p.n) + ", k=" + str(p.k) +
                           ", batch=" + str(p.batch) + ", splits=" + str(p.splits);
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::check_sizes(kOp, "m, n, k and batch", {p.m, p.n, p.k, p.batch}, 30, dims));
  DType in, in_b, out = DType::kF32;
  if (!ffi_util::to_fp8_dtype(buf.a->element_type(), &in) ||
      !ffi_util::to_fp8_dtype(buf.b->element_type(), &in_b) ||
      in != in_b) {
    return ffi::Error::InvalidArgument(
        "jax_tma fp8: a and b must both be float8_e4m3fn or both float8_e5m2");
  }
  if (!ffi_util::to_dtype(buf.out->element_type(), &out) ||
      (out != DType::kBF16 && out != DType::kF32)) {
    return ffi::Error::InvalidArgument("jax_tma fp8: out must be bf16 or fp32");
  }
  for (const ffi::AnyBuffer* v : {buf.sa, buf.sb, buf.row_scale, buf.col_scale, buf.bias}) {
    if (v->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("jax_tma fp8: the scales and the bias must be fp32");
    }
  }
  const int64_t kb = (p.k + kScaleBlock - 1) / kScaleBlock;
  const int64_t nb = (p.n + kScaleBlock - 1) / kScaleBlock;
  if (p.row_scale < 0 || p.row_scale > 2 || p.col_scale < 0 || p.col_scale > 2) {
    return ffi::Error::InvalidArgument("jax_tma fp8: row_scale and col_scale must be 0 (none), "
                                       "1 (one value) or 2 (a vector), got " +
                                       str(p.row_scale) + " and " + str(p.col_scale));
  }
  if ((p.promote != 0 && p.promote != 1) || (!p.promote && (p.has_sa || p.has_sb))) {
    return ffi::Error::InvalidArgument("jax_tma fp8: promote must be 1, or 0 (fast accumulation) "
                                       "without block scales, got promote=" + str(p.promote) +
                                       ", has_sa=" + str(p.has_sa) + ", has_sb=" + str(p.has_sb));
  }
  if (p.k % 16 || p.n % 8 || (p.has_sa && (p.sa_ld < p.m || p.sa_ld % 4)) ||
      (p.has_sb && (p.sb_ld < nb || p.sb_ld % 4))) {
    return ffi::Error::InvalidArgument(
        "jax_tma fp8: TMA needs 16-byte rows: k must be a multiple of 16, n of 8, sa_ld >= m "
        "and sb_ld >= ceil(n / 128) of 4, got " + dims + ", sa_ld=" + str(p.sa_ld) +
        ", sb_ld=" + str(p.sb_ld));
  }
  if (p.stream_k != 0 && (p.stream_k != 1 || p.splits != 1)) {
    return ffi::Error::InvalidArgument(
        "jax_tma fp8: stream_k must be 0 or 1, and 1 only without split-K, got stream_k=" +
        str(p.stream_k) + ", splits=" + str(p.splits));
  }
  int64_t per_split = 0;
  JAX_TMA_RETURN_IF_ERROR(
      ffi_util::check_splits(kOp, p.splits, kb, kScaleBlock, out == DType::kF32, dims, &per_split));
  const int64_t batch_a = p.a_batched ? p.batch : 1;
  const int64_t batch_b = p.b_batched ? p.batch : 1;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      kOp,
      {{"a", batch_a * p.m * p.k, buf.a->element_count()},
       {"b", batch_b * p.n * p.k, buf.b->element_count()},
       {"sa", p.has_sa ? batch_a * kb * p.sa_ld : 1, buf.sa->element_count()},
       {"sb", p.has_sb ? batch_b * kb * p.sb_ld : 1, buf.sb->element_count()},
       {"row_scale", p.row_scale == 2 ? p.m : 1, buf.row_scale->element_count()},
       {"col_scale", p.col_scale == 2 ? p.n : 1, buf.col_scale->element_count()},
       {"bias", p.has_bias ? p.n : 1, buf.bias->element_count()},
       {"out", p.splits * p.batch * p.m * p.n, buf.out->element_count()}},
      dims));
  const ffi_util::DeviceInfo* info = nullptr;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sm90_device(kOp, device, &info));
  LaunchArgs args{};
  args.shape = ffi_util::problem_shape(p.m, p.n, p.k, p.batch, p.splits, per_split,
                                       p.a_batched != 0, p.b_batched != 0);
  args.num_sms = info->num_sms;
  args.stream = stream;
  args.stream_k = p.stream_k == 1;
  args.workspace = buf.workspace->untyped_data();
  args.workspace_bytes = static_cast<int64_t>(buf.workspace->size_bytes());
  return dispatch(p, in, out, buf, args);
}

// The handlers' implementation (the binding follows from its parameters: ffi/dispatch.h).
ffi::Error fp8_gemm_sm90(cudaStream_t stream, int32_t device,
                         ffi::AnyBuffer a,                 // FP8
                         ffi::AnyBuffer b,                 // FP8, a's type
                         ffi::AnyBuffer sa,                // fp32 block scales of a
                         ffi::AnyBuffer sb,                // fp32 block scales of b
                         ffi::AnyBuffer row_scale,         // fp32
                         ffi::AnyBuffer col_scale,         // fp32
                         ffi::AnyBuffer bias,              // fp32
                         ffi::Result<ffi::AnyBuffer> out,        // bf16 or fp32
                         ffi::Result<ffi::AnyBuffer> workspace,  // stream-K workspace
                         Fp8Attrs attrs) {
  return fp8_gemm(stream, device,
                  Buffers{&a, &b, &sa, &sb, &row_scale, &col_scale, &bias, &*out, &*workspace},
                  attrs);
}

}  // namespace
}  // namespace jax_tma::ffi_handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::Fp8Attrs,
    xla::ffi::StructMember<int64_t>("block_m"),
    xla::ffi::StructMember<int64_t>("block_n"),
    xla::ffi::StructMember<int64_t>("stages"),
    xla::ffi::StructMember<int64_t>("cluster_m"),
    xla::ffi::StructMember<int64_t>("promote"),        // 0: fast accumulation
    xla::ffi::StructMember<int64_t>("splits"),         // split-K ranges (fp32 partial products)
    xla::ffi::StructMember<int64_t>("stream_k"),       // 1: stream-K last wave
    xla::ffi::StructMember<int64_t>("m"),
    xla::ffi::StructMember<int64_t>("n"),
    xla::ffi::StructMember<int64_t>("k"),
    xla::ffi::StructMember<int64_t>("batch"),
    xla::ffi::StructMember<int64_t>("a_batched"),      // 0: a (and sa) shared by every entry
    xla::ffi::StructMember<int64_t>("b_batched"),      // 0: b (and sb) shared by every entry
    xla::ffi::StructMember<int64_t>("sa_ld"),          // sa's row length (>= m)
    xla::ffi::StructMember<int64_t>("sb_ld"),          // sb's row length (>= ceil(n / 128))
    xla::ffi::StructMember<int64_t>("has_sa"),         // A has block scales
    xla::ffi::StructMember<int64_t>("has_sb"),         // B has block scales
    xla::ffi::StructMember<int64_t>("row_scale"),      // 0 none, 1 one value, 2 [m]
    xla::ffi::StructMember<int64_t>("col_scale"),      // 0 none, 1 one value, 2 [n]
    xla::ffi::StructMember<int64_t>("has_bias"));

namespace jax_tma::ffi_handlers {

// Fp8GemmSm90Into takes out_in after bias, aliased to out.
JAX_TMA_DEFINE_HANDLER_PAIR(Fp8GemmSm90, Fp8GemmSm90Into, fp8_gemm_sm90, 1);

}  // namespace jax_tma::ffi_handlers
