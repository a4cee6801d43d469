// XLA FFI handler of the fused dense products on Hopper (sm_90a): argument checks, tensor maps
// and the launch of the (tile, layout, fusion) kernel the attributes name
// (contract/sm90_dense.h).
//
// Dense row-major operands; every one is passed, unused ones as 1-element placeholders:
//   a     [m, k]                       x (forward, gated) or dy (gradient)
//   b     [k, n] (b_k_major=0)         w; gradient: [n, k] (b_k_major=1), w read transposed
//   b2    [k, n]                       gated: the up weights
//   bias  [n] fp32, bf16 or fp16       has_bias
//   aux   [m, n]                       has_aux: the residual (forward) or the saved
//                                      pre-activation (gradient); gated gradient: [2, m, n],
//                                      the gate's and the up's
// -> out [m, n], pre (store_pre; else [1]): [m, n] the pre-activation z, gated [2, m, n] the gate's
// and the up's, gated gradient (always) [m, n] the up's cotangent; workspace (stream-K; any size
// without).
// kind: 1 bias + activation, 2 activation gradient, 3 gated, 5 gated gradient (epilogue/fusion.h);
// activation: 0 none, 1 relu, 2 gelu (tanh), 3 gelu (erf), 4 silu. a, b, b2, aux, out and pre
// share one 16-bit type; k and n are multiples of 8.
#include "ffi/dense.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/checks.h"
#include "ffi/cuda_check.h"
#include "ffi/device_info.h"
#include "ffi/dispatch.h"
#include "ffi/gemm_maps.h"
#include "ffi/tensor_map.h"
#include "contract/sm90_dense.h"
#include "contract/sm90_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tma::ffi_handlers {

struct DenseAttrs {
  int64_t kind, activation, has_bias, has_aux, store_pre, b_k_major;
  int64_t block_m, block_n, stages, cluster_m, stream_k;
  int64_t m, n, k;
};

namespace {

constexpr char kOp[] = "jax_tma dense";  // every message's prefix

using ffi_util::str;
using ffi_util::ViewDim;
using sm90_gemm::DType;
using sm90_gemm::FusedLaunch;
using sm90_gemm::LaunchArgs;
using sm90_gemm::Major;

struct Buffers {
  const ffi::AnyBuffer* a;
  const ffi::AnyBuffer* b;
  const ffi::AnyBuffer* b2;
  const ffi::AnyBuffer* bias;
  const ffi::AnyBuffer* aux;
  ffi::AnyBuffer* out;
  ffi::AnyBuffer* pre;
  ffi::AnyBuffer* workspace;
};

// The bias's element type as the epilogue reads it; false where it is not fp32, bf16 or fp16.
bool bias_type(ffi::DataType t, VectorType* out) {
  DType d;
  if (!ffi_util::to_dtype(t, &d)) return false;
  *out = d == DType::kBF16  ? VectorType::kBF16
         : d == DType::kF16 ? VectorType::kF16
                            : VectorType::kF32;
  return true;
}

template <class Fusion>
bool fusion_matches(const DenseAttrs& p) {
  return p.kind == static_cast<int64_t>(Fusion::kKind) &&
         p.activation == static_cast<int64_t>(Fusion::kAct);
}

template <class Tile, class Layout, class Fusion>
ffi::Error run(const DenseAttrs& p, DType in, const Buffers& buf, LaunchArgs args) {
  using Boxes = sm90_gemm::OperandBoxes<Tile, Layout>;
  const int64_t acc_n = Fusion::kGated ? 2 * p.n : p.n;  // accumulator columns
  const int64_t units = (p.m + Tile::kBlockM - 1) / Tile::kBlockM *
                        ((acc_n + Tile::kBlockN - 1) / Tile::kBlockN);
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_work_units(kOp, units));
  if (p.stream_k && !Tile::kStreamK) {
    return ffi::Error::InvalidArgument("jax_tma dense: stream_k=1 needs a 128-row tile without "
                                       "a cluster");
  }
  const int box_a[3] = {Boxes::kBoxA[0], Boxes::a_rows(p.m), 1};
  args.shape.a_stage_bytes = Boxes::a_stage_bytes(p.m);
  constexpr bool kGatedGrad = Fusion::kKind == FusionKind::kGatedGrad;
  const int64_t out_bytes = p.m * p.n * sm90_gemm::dtype_bytes(in);  // one [m, n] operand
  CUtensorMap map_a, map_b, map_b2 = {}, map_d, map_aux = {}, map_aux2 = {}, map_pre = {},
              map_pre2 = {};
  JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(
      kOp, &map_a, buf.a->untyped_data(),
      ffi_util::operand_spec<Major::kK>(in, {p.m, p.k, "m"}, {p.k, 1, "k"}, {1, 0, "batch"},
                                        box_a)));
  const ViewDim b_n = Layout::kB == Major::kK ? ViewDim{p.n, p.k, "n"} : ViewDim{p.n, 1, "n"};
  const ViewDim b_k = Layout::kB == Major::kK ? ViewDim{p.k, 1, "k"} : ViewDim{p.k, p.n, "k"};
  const auto b_spec =
      ffi_util::operand_spec<Layout::kB>(in, b_n, b_k, {1, 0, "batch"}, Boxes::kBoxB);
  JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kOp, &map_b, buf.b->untyped_data(), b_spec));
  if (Fusion::kGated) {
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kOp, &map_b2, buf.b2->untyped_data(), b_spec));
  }
  // D, and the aux operand and second output in D's shape, in boxes of `box_rows` rows.
  const auto spec = [&](int box_rows) {
    return ffi_util::output_spec(in, {p.n, 1, "n"}, {p.m, p.n, "m"}, {1, 0, "batch"},
                                 {1, 0, "split"}, Tile::kEpilogueRowBytes, box_rows);
  };
  const auto out_spec = spec(Tile::kEpilogueRows);
  JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kOp, &map_d, buf.out->untyped_data(), out_spec));
  // The gated gradient's epilogue warps load and store its [M, N] operands half a chunk at a
  // time (epilogue/epilogue_warps.cuh): boxes of half D's rows.
  const auto aux_spec = kGatedGrad ? spec(Tile::kEpilogueRows / 2) : out_spec;
  if (p.has_aux) {
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kOp, &map_aux, buf.aux->untyped_data(), aux_spec));
  }
  if (kGatedGrad) {  // the up's pre-activations follow the gate's
    auto* up = static_cast<uint8_t*>(buf.aux->untyped_data()) + out_bytes;
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kOp, &map_aux2, up, aux_spec));
  }
  if (p.store_pre || kGatedGrad) {
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kOp, &map_pre, buf.pre->untyped_data(), aux_spec));
  }
  if (p.store_pre && Fusion::kGated) {
    auto* up = static_cast<uint8_t*>(buf.pre->untyped_data()) + out_bytes;
    JAX_TMA_RETURN_IF_ERROR(ffi_util::encode(kOp, &map_pre2, up, out_spec));
  }
  args.shape.n = static_cast<int>(acc_n);
  args.tmap_a = &map_a;
  args.tmap_b = &map_b;
  args.tmap_d = &map_d;
  args.d = buf.out->untyped_data();
  FusedLaunch fused{Fusion::kGated ? &map_b2 : nullptr, p.has_aux ? &map_aux : nullptr,
                    kGatedGrad ? &map_aux2 : nullptr,
                    p.store_pre || kGatedGrad ? &map_pre : nullptr,
                    p.store_pre && Fusion::kGated ? &map_pre2 : nullptr, {}};
  fused.args.bias = p.has_bias ? buf.bias->untyped_data() : nullptr;
  bias_type(buf.bias->element_type(), &fused.args.bias_type);  // checked by dense()
  fused.args.aux = p.has_aux != 0;
  fused.args.store_pre = p.store_pre != 0;
  const cudaError_t launched =
      in == DType::kBF16
          ? sm90_gemm::launch_fused<__nv_bfloat16, Tile, Layout, Fusion>(args, fused)
          : sm90_gemm::launch_fused<__half, Tile, Layout, Fusion>(args, fused);
  return ffi_util::cuda_error(launched, "jax_tma dense launch");
}

#define JAX_TMA_KERNEL(TILE, LAYOUT, FUSION) \
  ffi_util::Kernel<sm90_gemm::TILE, sm90_gemm::LAYOUT, sm90_gemm::FUSION>,
using Kernels = ffi_util::KernelList<JAX_TMA_SM90_DENSE_KERNELS(JAX_TMA_KERNEL) void>;
#undef JAX_TMA_KERNEL

ffi::Error dispatch(const DenseAttrs& p, DType in, const Buffers& buf, const LaunchArgs& args) {
  const Major b_major = p.b_k_major ? Major::kK : Major::kMN;
  return ffi_util::dispatch(
      Kernels{}, p,
      [&](auto kernel) {
        using K = decltype(kernel);
        return fusion_matches<typename K::Variant>(p) && K::Layout::kB == b_major;
      },
      [&](auto kernel) {
        using K = decltype(kernel);
        return run<typename K::Tile, typename K::Layout, typename K::Variant>(p, in, buf, args);
      },
      [&] {
        return ffi::Error::InvalidArgument(
            "jax_tma dense: no compiled kernel with kind=" + str(p.kind) + ", activation=" +
            str(p.activation) + ", b_k_major=" + str(p.b_k_major) + ", " +
            ffi_util::describe_tile(p));
      });
}

ffi::Error dense(cudaStream_t stream, int32_t device, const Buffers& buf, const DenseAttrs& p) {
  const std::string dims = "m=" + str(p.m) + ", n=" + str(p.n) + ", k=" + str(p.k);
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sizes(kOp, "m, n and k", {p.m, p.n, p.k}, 30, dims));
  DType in = DType::kF32;
  bool typed = ffi_util::to_dtype(buf.a->element_type(), &in) && in != DType::kF32;
  for (const ffi::AnyBuffer* b : {buf.b, buf.b2, buf.aux,
                                  static_cast<const ffi::AnyBuffer*>(buf.out),
                                  static_cast<const ffi::AnyBuffer*>(buf.pre)}) {
    DType t;
    typed = typed && ffi_util::to_dtype(b->element_type(), &t) && t == in;
  }
  if (!typed) {
    return ffi::Error::InvalidArgument(
        "jax_tma dense: a, b, b2, aux, out and pre must share one type, bf16 or fp16");
  }
  if (VectorType unused; !bias_type(buf.bias->element_type(), &unused)) {
    return ffi::Error::InvalidArgument("jax_tma dense: bias must be fp32, bf16 or fp16");
  }
  const bool gated = p.kind == 3, gated_grad = p.kind == 5;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_element_counts(
      kOp,
      {{"a", p.m * p.k, buf.a->element_count()},
       {"b", p.k * p.n, buf.b->element_count()},
       {"b2", gated ? p.k * p.n : 1, buf.b2->element_count()},
       {"bias", p.has_bias ? p.n : 1, buf.bias->element_count()},
       {"aux", p.has_aux ? (gated_grad ? 2 : 1) * p.m * p.n : 1, buf.aux->element_count()},
       {"out", p.m * p.n, buf.out->element_count()},
       {"pre", p.store_pre ? (gated ? 2 : 1) * p.m * p.n : gated_grad ? p.m * p.n : 1,
        buf.pre->element_count()}},
      dims));
  if (p.k % 8 || p.n % 8) {
    return ffi::Error::InvalidArgument(
        "jax_tma dense: TMA needs rows of 16-byte multiples: k and n must be multiples of 8 (" +
        dims + ")");
  }
  const bool known = p.kind >= 1 && p.kind <= 5 && p.kind != 4;  // 4: Scaled, FP8 only
  if (!known || ((p.kind == 2 || p.kind == 5) && (!p.has_aux || p.store_pre)) ||
      (p.kind != 1 && p.has_bias) || (p.kind == 3 && p.has_aux)) {
    return ffi::Error::InvalidArgument(
        "jax_tma dense: kind=" + str(p.kind) + " takes has_bias=" + str(p.has_bias) +
        ", has_aux=" + str(p.has_aux) + ", store_pre=" + str(p.store_pre) +
        " (kind 1: any; kinds 2 and 5: aux, no bias or store_pre; kind 3: store_pre only)");
  }
  const ffi_util::DeviceInfo* info = nullptr;
  JAX_TMA_RETURN_IF_ERROR(ffi_util::check_sm90_device(kOp, device, &info));
  LaunchArgs args{};
  // run() sets N: a gated product's accumulator is twice as wide.
  args.shape = ffi_util::problem_shape(p.m, p.n, p.k, 1, 1, (p.k + 63) / 64);
  args.stream_k = p.stream_k == 1;
  args.workspace = buf.workspace->untyped_data();
  args.workspace_bytes = static_cast<int64_t>(buf.workspace->size_bytes());
  args.num_sms = info->num_sms;
  args.stream = stream;
  return dispatch(p, in, buf, args);
}

// The handlers' implementation (the binding follows from its parameters: ffi/dispatch.h).
ffi::Error dense_sm90(cudaStream_t stream, int32_t device,
                      ffi::AnyBuffer a,                       // x or dy
                      ffi::AnyBuffer b,                       // w
                      ffi::AnyBuffer b2,                      // gated up weights
                      ffi::AnyBuffer bias,                    // fp32, bf16 or fp16
                      ffi::AnyBuffer aux,                     // residual or pre-activation
                      ffi::Result<ffi::AnyBuffer> out,        // out
                      ffi::Result<ffi::AnyBuffer> pre,        // pre
                      ffi::Result<ffi::AnyBuffer> workspace,  // stream-K workspace
                      DenseAttrs attrs) {
  return dense(stream, device, Buffers{&a, &b, &b2, &bias, &aux, &*out, &*pre, &*workspace},
               attrs);
}

}  // namespace
}  // namespace jax_tma::ffi_handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_tma::ffi_handlers::DenseAttrs,
    xla::ffi::StructMember<int64_t>("kind"),        // 1 bias+act, 2 grad, 3 gated, 5 gated grad
    xla::ffi::StructMember<int64_t>("activation"),  // epilogue/fusion.h Activation
    xla::ffi::StructMember<int64_t>("has_bias"),
    xla::ffi::StructMember<int64_t>("has_aux"),
    xla::ffi::StructMember<int64_t>("store_pre"),
    xla::ffi::StructMember<int64_t>("b_k_major"),   // b stored [n, k]
    xla::ffi::StructMember<int64_t>("block_m"),
    xla::ffi::StructMember<int64_t>("block_n"),
    xla::ffi::StructMember<int64_t>("stages"),
    xla::ffi::StructMember<int64_t>("cluster_m"),
    xla::ffi::StructMember<int64_t>("stream_k"),
    xla::ffi::StructMember<int64_t>("m"),
    xla::ffi::StructMember<int64_t>("n"),           // output columns
    xla::ffi::StructMember<int64_t>("k"));

namespace jax_tma::ffi_handlers {

// DenseSm90Into takes out_in and pre_in after aux, aliased to out and pre.
JAX_TMA_DEFINE_HANDLER_PAIR(DenseSm90, DenseSm90Into, dense_sm90, 2);

}  // namespace jax_tma::ffi_handlers
