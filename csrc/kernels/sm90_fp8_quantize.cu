// The one-pass block quantiser; see contract/sm90_fp8_quantize.h.
#include "contract/sm90_fp8_quantize.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace jax_tma::fp8_quantize {
namespace {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kPasses = kBlock / kWarps;  // rows per thread: warp w takes w, w + 8, ...
inline constexpr float kInvE4m3Max = 1.0f / 448.0f;  // rounded to fp32
// Transposed bytes of the block, [col][row], rows padded by 4 bytes against bank conflicts.
inline constexpr int kTileRowBytes = kBlock + 4;

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }

// Four consecutive elements from an address aligned to four of them.
__device__ __forceinline__ void load4(const float* p, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
template <class T>
__device__ __forceinline__ void load4(const T* p, float* out) {  // 16-bit: 8 bytes
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const T* v = reinterpret_cast<const T*>(&raw);
  for (int j = 0; j < 4; ++j) out[j] = widen(v[j]);
}

// e4m3 bytes of (a, b): rounded to nearest even; beyond +-448 (infinities too) +-448, as the
// XLA form's clamp before its conversion; NaN stays NaN.
__device__ __forceinline__ uint32_t e4m3_pair(float a, float b) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// The block in fp32, [row][col]: the values wait here between the maximum and the division
// (held in registers instead, they spill around the division's slow-path call).
struct alignas(16) Staging {
  float block[kBlock * kBlock];
  uint8_t tile_t[kBlock * kTileRowBytes];
  float warp_max[kWarps];
};

// kVec: both parts' columns are multiples of 4 (rows of x 16-byte aligned in fp32, 8-byte in
// 16-bit; rows of the values 4-byte aligned), so each thread loads and stores four at once.
template <class In, bool kVec>
__global__ void __launch_bounds__(kThreads, 2) quantize_blocks(QuantizeParams p) {
  extern __shared__ uint8_t smem_raw[];
  Staging& s = *reinterpret_cast<Staging*>(smem_raw);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBlock;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kBlock;
  const int64_t rb = gridDim.y, cb = gridDim.x;
  const int64_t col = c0 + 4 * lane;
  // The part this block reads (its columns all in one: the first part's count is a multiple of
  // 128), its row length and the block's first column there.
  const bool second = c0 >= p.cols0;
  const int64_t src_cols = second ? p.cols - p.cols0 : p.cols0;
  const int64_t src_col = col - (second ? p.cols0 : 0);
  for (int64_t b = blockIdx.z; b < p.batch; b += gridDim.z) {
    const In* x = static_cast<const In*>(second ? p.x2 : p.x) + b * p.rows * src_cols;
    float amax = 0.0f;
    bool nan = false;
    // Each thread's 16 rows of four columns: loaded all at once (16-byte or 8-byte vectors)
    // before any is used, then staged; element by element where cols is not a multiple of 4.
    auto stage = [&](int r, const float (&v)[4]) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        amax = fmaxf(amax, fabsf(v[j]));
        nan |= v[j] != v[j];
      }
      *reinterpret_cast<float4*>(&s.block[r * kBlock + 4 * lane]) =
          make_float4(v[0], v[1], v[2], v[3]);
    };
    if constexpr (kVec) {
      float v[kPasses][4];
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        const int64_t row = r0 + warp + kWarps * i;
        if (row < p.rows && src_col < src_cols) {
          load4(x + row * src_cols + src_col, v[i]);
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) v[i][j] = 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < kPasses; ++i) stage(warp + kWarps * i, v[i]);
    } else {
#pragma unroll 4
      for (int i = 0; i < kPasses; ++i) {
        const int64_t row = r0 + warp + kWarps * i;
        const In* src = x + row * src_cols + src_col;
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[j] = row < p.rows && src_col + j < src_cols ? widen(src[j]) : 0.0f;
        }
        stage(warp + kWarps * i, v);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    if (lane == 0) s.warp_max[warp] = amax;
    nan = __syncthreads_or(nan);
    amax = s.warp_max[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) amax = fmaxf(amax, s.warp_max[w]);
    // The XLA form's where(amax > 0, amax / 448, 1), its division by the constant made a
    // product with the constant's fp32 reciprocal as XLA makes it; its maximum propagates a
    // NaN, which fails the comparison.
    const float scale = !nan && amax > 0.0f ? __fmul_rn(amax, kInvE4m3Max) : 1.0f;

    uint8_t* values = p.values + b * p.rows * p.cols;
    for (int i = 0; i < kPasses; ++i) {
      const int r = warp + kWarps * i;
      const int64_t row = r0 + r;
      const float4 v = *reinterpret_cast<const float4*>(&s.block[r * kBlock + 4 * lane]);
      const uint32_t lo = e4m3_pair(__fdiv_rn(v.x, scale), __fdiv_rn(v.y, scale));
      const uint32_t hi = e4m3_pair(__fdiv_rn(v.z, scale), __fdiv_rn(v.w, scale));
      const uint32_t bytes = lo | (hi << 16);
      if (row < p.rows) {
        uint8_t* dst = values + row * p.cols + col;
        if (kVec && col < p.cols) {
          *reinterpret_cast<uint32_t*>(dst) = bytes;
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (col + j < p.cols) dst[j] = static_cast<uint8_t>(bytes >> (8 * j));
          }
        }
      }
      if (p.values_t != nullptr) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          s.tile_t[(4 * lane + j) * kTileRowBytes + r] = static_cast<uint8_t>(bytes >> (8 * j));
        }
      }
    }
    if (threadIdx.x == 0) p.scales[(b * cb + blockIdx.x) * rb + blockIdx.y] = scale;
    if (p.values_t != nullptr) {
      __syncthreads();
      // Warp w writes columns w, w + 8, ... of the block as rows of values_t, lane l its rows
      // 4l .. 4l + 3.
      uint8_t* values_t = p.values_t + b * p.rows * p.cols;
      const int64_t row = r0 + 4 * lane;
      const bool aligned = p.rows % 4 == 0;
#pragma unroll 4
      for (int i = 0; i < kPasses; ++i) {
        const int c = warp + kWarps * i;
        if (c0 + c >= p.cols) break;
        const uint32_t bytes =
            *reinterpret_cast<const uint32_t*>(&s.tile_t[c * kTileRowBytes + 4 * lane]);
        uint8_t* dst = values_t + (c0 + c) * p.rows + row;
        if (aligned && row < p.rows) {
          *reinterpret_cast<uint32_t*>(dst) = bytes;
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (row + j < p.rows) dst[j] = static_cast<uint8_t>(bytes >> (8 * j));
          }
        }
      }
    }
    __syncthreads();  // the staging is rewritten for the next batch entry
  }
}

template <class In>
cudaError_t launch(const QuantizeParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.cols + kBlock - 1) / kBlock),
                  static_cast<unsigned>((p.rows + kBlock - 1) / kBlock),
                  static_cast<unsigned>(p.batch < 65535 ? p.batch : 65535));
  const bool vec = p.cols % 4 == 0 && p.cols0 % 4 == 0;
  const auto kernel = vec ? quantize_blocks<In, true> : quantize_blocks<In, false>;
  constexpr int kSmem = static_cast<int>(sizeof(Staging));
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             kSmem);
      err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_blocks(const QuantizeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.rows == 0 || p.cols == 0) return cudaSuccess;
  switch (p.input) {
    case Input::kF32:
      return launch<float>(p, stream);
    case Input::kBF16:
      return launch<__nv_bfloat16>(p, stream);
    case Input::kF16:
      return launch<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_tma::fp8_quantize
