// Tensor Memory Accelerator wrappers (cp.async.bulk.tensor and friends).
// Tensor maps are CUtensorMap objects encoded on the host (csrc/ffi/tensor_map.h) and passed
// as `const __grid_constant__` kernel parameters; coordinates are element indices, innermost
// dimension first. Loads complete on an mbarrier (complete_tx::bytes); out-of-bounds box
// elements are zero-filled on load and clipped on store.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "ptx/common.cuh"

namespace jax_tma::ptx {

// prefetch.tensormap: pull the descriptor into the constant cache ahead of the first copy.
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Coordinates of a box corner, innermost dimension first; unused trailing entries ignored.
template <int kRank>
struct TmaCoord {
  static_assert(kRank >= 1 && kRank <= 5, "TMA tensors have rank 1..5");
  int32_t c[kRank];
};

// Tile load global -> shared (rank 1..5), completing the box's bytes on `bar`.
__device__ __forceinline__ void tma_load(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                         TmaCoord<1> x) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x.c[0])
      : "memory");
}
__device__ __forceinline__ void tma_load(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                         TmaCoord<2> x) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x.c[0]), "r"(x.c[1])
      : "memory");
}
__device__ __forceinline__ void tma_load(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                         TmaCoord<3> x) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x.c[0]), "r"(x.c[1]),
      "r"(x.c[2])
      : "memory");
}
__device__ __forceinline__ void tma_load(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                         TmaCoord<4> x) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x.c[0]), "r"(x.c[1]),
      "r"(x.c[2]), "r"(x.c[3])
      : "memory");
}
__device__ __forceinline__ void tma_load(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                         TmaCoord<5> x) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x.c[0]), "r"(x.c[1]),
      "r"(x.c[2]), "r"(x.c[3]), "r"(x.c[4])
      : "memory");
}

// 2-D tile load (the GEMM mainloop's form).
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map,
                                            uint64_t* bar, int32_t c0, int32_t c1) {
  tma_load(smem_dst, map, bar, TmaCoord<2>{{c0, c1}});
}

// 2-D tile load multicast to the CTAs of this cluster whose bit is set in `cta_mask`: the box
// lands at the same shared-memory offset in each of them and completes on each one's barrier
// at the offset of `bar`.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map,
                                                      uint64_t* bar, uint16_t cta_mask,
                                                      int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%4, %5}], [%2], %3;" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask), "r"(c0),
      "r"(c1)
      : "memory");
}

// 3-D tile load multicast (the batched GEMM mainloop's form): as tma_load_2d_multicast, with
// coordinates {inner, outer, batch}.
__device__ __forceinline__ void tma_load_multicast(void* smem_dst, const CUtensorMap* map,
                                                   uint64_t* bar, uint16_t cta_mask,
                                                   TmaCoord<3> x) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%4, %5, %6}], [%2], %3;" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask), "r"(x.c[0]),
      "r"(x.c[1]), "r"(x.c[2])
      : "memory");
}

// Multicast masks for a cluster of cluster_m x cluster_n CTAs, ranked m + n * cluster_m.
// The CTAs that share column-of-tiles n (every m): they all read the same B tile.
__host__ __device__ __forceinline__ uint16_t multicast_mask_same_n(uint32_t cluster_m,
                                                                   uint32_t n) {
  return static_cast<uint16_t>(((1u << cluster_m) - 1u) << (n * cluster_m));
}
// The CTAs that share row-of-tiles m (every n): they all read the same A tile.
__host__ __device__ __forceinline__ uint16_t multicast_mask_same_m(uint32_t cluster_m,
                                                                   uint32_t cluster_n,
                                                                   uint32_t m) {
  uint32_t mask = 0;
  for (uint32_t n = 0; n < cluster_n; ++n) mask |= 1u << (m + n * cluster_m);
  return static_cast<uint16_t>(mask);
}

// Tile store shared -> global (rank 1..5), tracked by this thread's bulk async-group.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* smem_src,
                                          TmaCoord<1> x) {
  asm volatile("cp.async.bulk.tensor.1d.global.shared::cta.bulk_group [%0, {%2}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(smem_src)), "r"(x.c[0])
               : "memory");
}
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* smem_src,
                                          TmaCoord<2> x) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(smem_src)), "r"(x.c[0]), "r"(x.c[1])
               : "memory");
}
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* smem_src,
                                          TmaCoord<3> x) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(x.c[0]), "r"(x.c[1]), "r"(x.c[2])
      : "memory");
}
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* smem_src,
                                          TmaCoord<4> x) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(x.c[0]), "r"(x.c[1]), "r"(x.c[2]), "r"(x.c[3])
      : "memory");
}
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* smem_src,
                                          TmaCoord<5> x) {
  asm volatile(
      "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], "
      "[%1];" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(x.c[0]), "r"(x.c[1]), "r"(x.c[2]), "r"(x.c[3]), "r"(x.c[4])
      : "memory");
}

// 2-D tile store (the GEMM epilogue's form).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem_src,
                                             int32_t c0, int32_t c1) {
  tma_store(map, smem_src, TmaCoord<2>{{c0, c1}});
}

// 2-D tile reduce-add shared -> global: global[box] += shared (split-K partial sums).
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* smem_src,
                                                  int32_t c0, int32_t c1) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(c0), "r"(c1)
      : "memory");
}

// cp.async.bulk.commit_group: close the current bulk async-group of this thread.
__device__ __forceinline__ void tma_store_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// cp.async.bulk.wait_group.read: at most kPending groups may still be reading shared memory.
// (The source buffers of the completed groups may be overwritten.)
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// cp.async.bulk.wait_group: at most kPending groups may still be in flight at all (their
// writes to global memory are complete and visible).
template <int kPending>
__device__ __forceinline__ void tma_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// fence.proxy.async.shared::cta: generic-proxy writes to shared memory become visible to the
// async proxy (TMA, wgmma) once the writing threads pass a barrier after this fence.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace jax_tma::ptx
