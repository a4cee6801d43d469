// FastDivmod: division of non-negative int32 values by a divisor fixed at launch, as a
// multiply-high, an add and a shift (round-up reciprocal, Granlund & Montgomery 1994). The host
// computes the reciprocal once; the device's per-tile index arithmetic then has no division
// routine in it (five of those cost ~600 cycles per tile in the tile scheduler).
#pragma once

#include <cstdint>

namespace jax_tma {

struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  // `d` in [1, 2^31). shift = ceil(log2 d), multiplier = floor(2^32 (2^shift - d) / d) + 1.
  __host__ explicit FastDivmod(int d) : divisor(static_cast<uint32_t>(d)) {
    while ((uint64_t{1} << shift) < divisor) ++shift;
    multiplier = static_cast<uint32_t>(
        ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  }

  // n / divisor for n in [0, 2^31): t <= n, so t + n does not wrap.
  __host__ __device__ int div(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#ifdef __CUDA_ARCH__
    const uint32_t t = __umulhi(u, multiplier);
#else
    const uint32_t t = static_cast<uint32_t>((uint64_t{u} * multiplier) >> 32);
#endif
    return static_cast<int>((t + u) >> shift);
  }
  // n / divisor, and n % divisor in *rem.
  __host__ __device__ int divmod(int n, int* rem) const {
    const int q = div(n);
    *rem = n - q * static_cast<int>(divisor);
    return q;
  }
};

// The same interface for a divisor known only on the device (one hardware division).
struct Divmod {
  int divisor;
  __host__ __device__ int divmod(int n, int* rem) const {
    const int q = n / divisor;
    *rem = n - q * divisor;
    return q;
  }
};

// The same interface for a divisor known at compile time.
template <int kDivisor>
struct ConstDivmod {
  static constexpr int divisor = kDivisor;
  __host__ __device__ int divmod(int n, int* rem) const {
    *rem = n % kDivisor;
    return n / kDivisor;
  }
};

}  // namespace jax_tma
