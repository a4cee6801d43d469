// Fused epilogues finished by the epilogue warps: on cooperative tiles both consumer warpgroups
// stop the tensor cores for their epilogue at once, so the elementwise work of a fusion (bias,
// activation, gating) would run with the tensor pipes idle (5 % of a 128 x 256 tile for bias +
// gelu). Here a consumer warpgroup only rounds its 64 x kBlockN block to the output type into
// its staging buffers (the plain epilogue's stmatrix pass) and hands it over
// (pipeline/epilogue_handoff.cuh); warps 1-3 of the producer warpgroup, idle otherwise, apply
// the fusion in place, 16 bytes at a time, store the block with TMA and give the buffers back,
// while the consumers run the next tile's mainloop.
//
// Staged block: kBlockN / 64 chunks of 64 rows x 64 16-bit columns, 128-byte swizzled (the
// plain epilogue's layout, epilogue/tma_store.cuh); gated blocks alternate gate and up chunks
// and store half as many. Rounding is the unfused 16-bit expression's: the product, the bias
// sum and the activation each round to the output type (gated: the activation, then the
// product with up), the activation itself computed in fp32 (epilogue/fusion.cuh).
// A residual arrives by TMA, chunk by chunk, in a ring of two more chunks (AuxRing) where the
// kernel has the shared memory for it (kernels/sm90_gemm_kernel.cuh); elsewhere the consumers'
// epilogue reads it into their staging buffers (epilogue/tma_store.cuh). The gradient fusions
// read their saved pre-activations through the ring too (they are offloaded only where it fits);
// the gated gradient's pair of them fills both slots, and its second output leaves from the up's
// slot. Where D's maps lie in global memory, one per segment of a grouped product
// (kSegmentMaps > 0: kernels/sm90_gemm_problems.cuh), the issuing thread acquires each before
// its stores, and a gated block's pre-activations leave through the maps after its D's; a gated
// gradient block's up cotangent leaves through the map after D's, and its pre-activations
// arrive through the two after that.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "epilogue/fusion.cuh"
#include "epilogue/tma_store.cuh"
#include "pipeline/epilogue_handoff.cuh"
#include "pipeline/named_barrier.cuh"
#include "pipeline/tma_store_pipeline.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/pack.cuh"
#include "ptx/stmatrix.cuh"
#include "ptx/tensormap.cuh"
#include "ptx/tma.cuh"

namespace jax_tma {

// What a consumer warpgroup hands over: a staged block to store at `to`, a block past D's rows
// (nothing to store: handed over so that both warpgroups hand over as many, but on a CTA's last
// tile, where it is not), a staged block of zeros to store as it is to D and every second output
// (a gated gradient's tile with nothing to contract), or the end.
enum class StagedBlock : int { kStore, kSkip, kZeros, kEnd };
struct StagedSlot {
  StorePlan to;
  StagedBlock kind;
};
using StagedHandoff = EpilogueHandoff<StagedSlot>;

// The handoff between consumer warpgroup `warpgroup` (128 threads) and the epilogue warps.
__device__ inline StagedHandoff staged_handoff(int warpgroup, int epilogue_threads) {
  const uint32_t threads = 128 + static_cast<uint32_t>(epilogue_threads);
  const uint32_t w = static_cast<uint32_t>(warpgroup);
  return StagedHandoff{
      NamedBarrier{static_cast<uint32_t>(NamedBarrierId::kHandoffFull0) + w, threads},
      NamedBarrier{static_cast<uint32_t>(NamedBarrierId::kHandoffEmpty0) + w, threads}};
}

// kSegmentMaps: 0 where the stores' maps are kernel parameters; else the maps per segment in
// global memory, D's first.
template <class Out, int kBlockN, class FusionT, int kSegmentMaps = 0>
struct EpilogueWarps {
  using F = FusionT;
  // Fusions finished here: 16-bit outputs of whole 64-column chunks; BiasActivation with a
  // residual, and ActivationGrad (which reads the pre-activation), only where the kernel gives
  // the warps an AuxRing.
  // NOTE: not the exact GELU (bias + gelu with erf is compiled on 128 x 128 tiles only), whose
  // erff spilled in the producer warpgroup's registers here.
  static constexpr bool kApplies =
      sizeof(Out) == 2 && kBlockN % 64 == 0 &&
      (((F::kKind == FusionKind::kBiasActivation || F::kKind == FusionKind::kActivationGrad) &&
        F::kAct != Activation::kGeluErf) ||
       F::kGated || F::kKind == FusionKind::kGatedGrad);
  static constexpr int kWarps = 3;  // warps 1-3 of the producer warpgroup
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kFirstThread = 32;
  static constexpr int kChunks = kBlockN / 64;
  static constexpr int kRows = 64;
  static constexpr int kUnits = 8;  // 16-byte units per 128-byte row of a chunk
  static constexpr int kRowStep = kThreads / kUnits;
  static_assert(kThreads % kUnits == 0);

  // The consumers' staging pass: the plain epilogue's over every chunk of the block.
  using Stage = TmaStoreEpilogue<Out, kBlockN, kApplies ? kChunks : 1, PlainFusion>;
  using SharedStorage = typename Stage::SharedStorage;
  using StorePipeline = PipelineTmaStore<1>;
  // The residual's chunks, each loaded by TMA with D's box (so in the staged chunks' layout),
  // completing on its slot's barrier (run()'s `loaded`).
  static constexpr int kAuxSlots = 2;
  using AuxRing = StagingBuffers<kAuxSlots>;
  using Block = StagedBlock;
  using Slot = StagedSlot;
  using Handoff = StagedHandoff;

  // ---------------------------------------------------------------- consumer warpgroup

  // Every thread of consumer warpgroup `warpgroup`: stage `acc` and hand it over to be stored
  // at `to` (a block past D's rows is handed over as a skip, so both warpgroups hand over as
  // many blocks).
  __device__ static void hand_off(const float (&acc)[kBlockN / 2], SharedStorage& smem,
                                  typename Handoff::SharedStorage& slot, const StorePlan& to,
                                  int warpgroup) {
    const Handoff handoff = staged_handoff(warpgroup, kThreads);
    const bool store = to.row < to.rows;
    handoff.acquire();
    if (threadIdx.x % 128 == 0) slot.slot = Slot{to, store ? Block::kStore : Block::kSkip};
    if (store) {
      Stage::template write_batch<0, Stage::Pass::kOut, false>(
          acc, smem, to, FusionArgs{}, std::make_integer_sequence<int, kChunks>{});
      ptx::fence_proxy_async_shared();  // the pre-activations may be stored as they are
    }
    handoff.commit();
  }

  // Every thread of consumer warpgroup `warpgroup`: hand over a block of zeros to be stored at
  // `to` (a work tile with nothing to contract), written into the staging buffers in place of
  // the accumulators (which, written on this path, would serialise the tile's wgmma). The gated
  // fusion's output and pre-activations of zeros are zeros (it runs as on any block); the gated
  // gradient's two cotangents are stored as zeros without reading the pre-activations (rows past
  // the last group: zero whatever they hold).
  __device__ static void hand_off_zeros(SharedStorage& smem,
                                        typename Handoff::SharedStorage& slot,
                                        const StorePlan& to, int warpgroup) {
    static_assert(F::kGated || F::kKind == FusionKind::kGatedGrad,
                  "a zero block's fusion must give zeros");
    constexpr Block kZeroBlock = F::kGated ? Block::kStore : Block::kZeros;
    const Handoff handoff = staged_handoff(warpgroup, kThreads);
    const bool store = to.row < to.rows;
    handoff.acquire();
    if (threadIdx.x % 128 == 0) slot.slot = Slot{to, store ? kZeroBlock : Block::kSkip};
    if (store) {
      constexpr int kUnits16 = kChunks * Stage::kChunkBytes / 16;
      for (int u = threadIdx.x % 128; u < kUnits16; u += 128) {
        reinterpret_cast<uint4*>(&smem.buffer[0][0])[u] = make_uint4(0, 0, 0, 0);
      }
      ptx::fence_proxy_async_shared();
    }
    handoff.commit();
  }

  // Every thread of the warpgroup, after its last block: no more blocks.
  __device__ static void close(typename Handoff::SharedStorage& slot, int warpgroup) {
    const Handoff handoff = staged_handoff(warpgroup, kThreads);
    handoff.acquire();
    if (threadIdx.x % 128 == 0) slot.slot = Slot{StorePlan{}, Block::kEnd};
    handoff.commit_end();
  }

  // ---------------------------------------------------------------- epilogue warps

  // What the epilogue warps read of the kernel's fused parameters (the args by reference, so
  // that they stay in the parameter bank).
  struct Operands {
    const FusionArgs& args;
    const CUtensorMap* aux;
    const CUtensorMap* aux2;  // gated gradient: the up's pre-activations (aux: the gate's)
    const CUtensorMap* pre;   // gated gradient: the up's cotangent
    const CUtensorMap* pre2;
  };
  using AuxLoads = EpilogueLoadRing<kAuxSlots>;

  // The block's rows within D's (the stores clip the rest, so they are left as staged: a
  // decode product of 16 rows transforms 16 of 64).
  __device__ static int rows_within(const StorePlan& to) { return min(kRows, to.rows - to.row); }

  // z[i] += bias[col + i] for 8 columns (read through L1 per row: nothing held across rows).
  template <class T>
  __device__ static void add_bias(const T* bias, int col, float (&z)[8]) {
    if constexpr (std::is_same_v<T, float>) {
      const float4 lo = __ldg(reinterpret_cast<const float4*>(bias + col));
      const float4 hi = __ldg(reinterpret_cast<const float4*>(bias + col) + 1);
      z[0] += lo.x, z[1] += lo.y, z[2] += lo.z, z[3] += lo.w;
      z[4] += hi.x, z[5] += hi.y, z[6] += hi.z, z[7] += hi.w;
    } else {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(bias + col));
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 p = ptx::unpack_pair<T>(w[i]);
        z[2 * i] += p.x;
        z[2 * i + 1] += p.y;
      }
    }
  }

  // A bias of the output's type, added to 8 staged values in pairs (add_pairs: the rounded sum
  // of the fp32 path, in a quarter of its instructions).
  __device__ static void add_bias_pairs(const Out* bias, int col, uint32_t (&w)[4]) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(bias + col));
    const uint32_t b[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = add_pairs<Out>(w[i], b[i]);
  }

  // Whether chunk `c` of the block at `to` holds columns of D (the rest are neither loaded nor
  // stored).
  __device__ static bool chunk_within(int c, const StorePlan& to) {
    return c < kChunks && 64 * c < to.cols - to.col;
  }

  // Issuer: chunk `c` of `map`'s [M, N] operand at the block `to` into ring slot `slot`.
  __device__ static void load_chunk(AuxRing& ring, AuxLoads& loads, int slot, int c,
                                    const StorePlan& to, const CUtensorMap* map) {
    uint64_t* bar = loads.arm(slot, Stage::kChunkBytes);
    ptx::tma_load(ring.buffer[slot], map, bar,
                  ptx::TmaCoord<4>{{to.col + 64 * c, to.row, to.batch, to.split}});
  }

  // Issuer: the residual's chunk `c` of the block at `to` into slot c % kAuxSlots.
  __device__ static void load_aux(AuxRing& ring, AuxLoads& loads, int c, const StorePlan& to,
                                  const CUtensorMap* aux) {
    if (chunk_within(c, to)) load_chunk(ring, loads, c % kAuxSlots, c, to, aux);
  }

  // The elementwise pass, in place over the chunks of D's columns. BiasActivation: z =
  // round(staged + bias) where kBias (of type T), then act(z) where kAct, then + the residual
  // where kAux (its first chunks loading already; each slot refilled once read).
  // ActivationGrad (kAux): staged * act'(pre-activation), the aux operand being the
  // pre-activation.
  template <bool kBias, bool kAct, bool kAux, class T = float>
  __device__ static void transform(SharedStorage& smem, const StorePlan& to, const Operands& in,
                                   int t, const NamedBarrier& barrier, AuxRing* ring,
                                   AuxLoads& loads) {
    const int unit = t % kUnits;
    const int rows = rows_within(to);
    const T* bias = static_cast<const T*>(in.args.bias);
    // A bias of the output's type is added in 16-bit pairs (add_pairs: the same bits as the
    // fp32 sum rounded, in a quarter of the instructions); with no activation (and not the
    // gradient's product) the residual too, and nothing is unpacked. (After an activation the
    // residual's sum stays in fp32: in pairs, fp16's 128 x 256 silu kernels with an fp32 bias
    // spilled 8 bytes a thread at the epilogue warps' 56 registers.)
    constexpr bool kPairBias = kBias && std::is_same_v<T, Out>;
    constexpr bool kPairsOnly = F::kKind != FusionKind::kActivationGrad && !kAct &&
                                (kPairBias || !kBias);
#pragma unroll 1
    for (int c = 0; c < kChunks; ++c) {
      if (64 * c >= to.cols - to.col) break;
      const int col = to.col + 64 * c + 8 * unit;
      const bool biased = kBias && col < to.cols;  // none past D's columns (N % 8 == 0)
      const uint32_t base = ptx::smem_u32(smem.buffer[c]);
      uint32_t aux_base = 0;
      if constexpr (kAux) {
        loads.wait(c % kAuxSlots);
        aux_base = ptx::smem_u32(ring->buffer[c % kAuxSlots]);
      }
#pragma unroll 1
      for (int row = t / kUnits; row < rows; row += kRowStep) {
        const uint32_t offset = Stage::swizzled(row, unit);
        const uint4 v = ptx::ld_shared_v4_b32(base + offset);
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
        if constexpr (kPairBias) {
          if (biased) add_bias_pairs(bias, col, w);
        }
        uint32_t out[4];
        if constexpr (kPairsOnly) {
          uint4 r = make_uint4(0, 0, 0, 0);
          if constexpr (kAux) r = ptx::ld_shared_v4_b32(aux_base + offset);
          const uint32_t res[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) out[i] = kAux ? add_pairs<Out>(w[i], res[i]) : w[i];
        } else {
          float z[8];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 p = ptx::unpack_pair<Out>(w[i]);
            z[2 * i] = p.x;
            z[2 * i + 1] = p.y;
          }
          if constexpr (kBias && !kPairBias) {
            if (biased) add_bias(bias, col, z);
          }
          uint4 r = make_uint4(0, 0, 0, 0);
          if constexpr (kAux) r = ptx::ld_shared_v4_b32(aux_base + offset);
          const uint32_t res[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float2 x = make_float2(z[2 * i], z[2 * i + 1]);
            if constexpr (F::kKind == FusionKind::kActivationGrad) {
              const float2 pre = ptx::unpack_pair<Out>(res[i]);
              x = make_float2(x.x * activate_grad<F::kAct>(pre.x),
                              x.y * activate_grad<F::kAct>(pre.y));
            } else {
              if constexpr (kBias && !kPairBias) x = round_pair<Out>(x);
              if constexpr (kAct) x = make_float2(activate<F::kAct>(x.x), activate<F::kAct>(x.y));
              if constexpr (kAux) {
                if constexpr (kAct) x = round_pair<Out>(x);
                const float2 y = ptx::unpack_pair<Out>(res[i]);
                x = make_float2(x.x + y.x, x.y + y.y);
              }
            }
            out[i] = ptx::pack_pair<Out>(x.x, x.y);
          }
        }
        ptx::st_shared_v4_b32(base + offset, make_uint4(out[0], out[1], out[2], out[3]));
      }
      if constexpr (kAux) {
        // Every thread has read the slot: refill it (the reads ordered before the async write).
        ptx::fence_proxy_async_shared();
        barrier.sync();
        if (t == 0) load_aux(*ring, loads, c + kAuxSlots, to, in.aux);
      }
    }
  }

  // As above with a bias, for its run-time type.
  template <bool kAct, bool kAux>
  __device__ static void transform_biased(SharedStorage& smem, const StorePlan& to,
                                          const Operands& in, int t, const NamedBarrier& barrier,
                                          AuxRing* ring, AuxLoads& loads) {
    switch (in.args.bias_type) {
      case VectorType::kBF16:
        return transform<true, kAct, kAux, __nv_bfloat16>(smem, to, in, t, barrier, ring, loads);
      case VectorType::kF16:
        return transform<true, kAct, kAux, __half>(smem, to, in, t, barrier, ring, loads);
      default:
        return transform<true, kAct, kAux, float>(smem, to, in, t, barrier, ring, loads);
    }
  }

  // Gated, in place: output chunk j = round(act(gate chunk 2j)) * up chunk 2j + 1, written over
  // the gate chunk.
  __device__ static void gate(SharedStorage& smem, const StorePlan& to, int t) {
    const int unit = t % kUnits;
    const int rows = rows_within(to);
#pragma unroll 1
    for (int j = 0; j < kChunks / 2; ++j) {
      if (64 * j >= to.cols - to.col) break;
      const uint32_t gate_base = ptx::smem_u32(smem.buffer[2 * j]);
      const uint32_t up_base = ptx::smem_u32(smem.buffer[2 * j + 1]);
#pragma unroll 1
      for (int row = t / kUnits; row < rows; row += kRowStep) {
        const uint32_t offset = Stage::swizzled(row, unit);
        const uint4 g = ptx::ld_shared_v4_b32(gate_base + offset);
        const uint4 u = ptx::ld_shared_v4_b32(up_base + offset);
        const uint32_t gates[4] = {g.x, g.y, g.z, g.w};
        const uint32_t ups[4] = {u.x, u.y, u.z, u.w};
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 x = ptx::unpack_pair<Out>(gates[i]);
          const uint32_t a = ptx::pack_pair<Out>(activate<F::kAct>(x.x), activate<F::kAct>(x.y));
          out[i] = mul_pairs<Out>(a, ups[i]);
        }
        ptx::st_shared_v4_b32(gate_base + offset, make_uint4(out[0], out[1], out[2], out[3]));
      }
    }
  }

  // GatedGrad, chunk by chunk and within a chunk by halves of 32 rows: the gate's
  // pre-activations g in ring slot 0 and the up's u in slot 1, both loaded one half at a time
  // (aux, aux2: maps of 32-row boxes), half h on the ring's barrier h; the gate's cotangent
  // dh * u * act'(g) written over the staged dh (the block's output, stored to D once both
  // halves are done), the up's dh * act(g) over u (stored from the slot to in.pre, a half at a
  // time). A half's next g loads once every thread has read it, its u once the up's store
  // has: so the next chunk's first half loads while this chunk's second half is computed.
  // NOTE: with whole chunks (the next chunk's g and u loaded only after this one's stores)
  // the warps waited for every chunk's loads with nothing to do, which cost the product where a
  // tile's mainloop is shorter than their pass (K = 2048); from K = 4096 on the two ran alike
  // (docs/notebook/2026-11-29-tile-registry-figures.md).
  static_assert(kAuxSlots == 2, "the gated gradient holds one chunk of g and one of u");
  static constexpr int kHalfRows = kRows / 2;
  static constexpr uint32_t kHalfBytes = Stage::kChunkBytes / 2;
  // Issuer: rows [kHalfRows h, kHalfRows (h + 1)) of chunk c's g and u into the halves of slots
  // 0 and 1, on barrier h; g's copy issued before the wait for the up's store to have read u's.
  __device__ static void load_half(AuxRing& ring, AuxLoads& loads, int h, int c,
                                   const StorePlan& to, const Operands& in) {
    uint64_t* bar = loads.arm(h, 2 * kHalfBytes);
    const ptx::TmaCoord<4> at{{to.col + 64 * c, to.row + kHalfRows * h, to.batch, to.split}};
    ptx::tma_load(ring.buffer[0] + h * kHalfBytes, in.aux, bar, at);
    StorePipeline::producer_tail();
    ptx::tma_load(ring.buffer[1] + h * kHalfBytes, in.aux2, bar, at);
  }

  __device__ static void gated_grad(SharedStorage& smem, const StorePlan& to, const Operands& in,
                                    int t, const NamedBarrier& barrier, AuxRing& ring,
                                    AuxLoads& loads) {
    const bool issuer = t == 0;
    const int unit = t % kUnits;
    const int rows = rows_within(to);
    const int halves = rows > kHalfRows ? 2 : 1;  // halves within D's rows
    if (issuer) {
      for (int h = 0; h < halves; ++h) load_half(ring, loads, h, 0, to, in);
    }
#pragma unroll 1
    for (int c = 0; chunk_within(c, to); ++c) {
      const uint32_t base = ptx::smem_u32(smem.buffer[c]);
#pragma unroll 1
      for (int h = 0; h < halves; ++h) {
        loads.wait(h);
        const int end = min(kHalfRows * (h + 1), rows);
        const uint32_t g_base = ptx::smem_u32(ring.buffer[0]);
        const uint32_t u_base = ptx::smem_u32(ring.buffer[1]);
#pragma unroll 1
        for (int row = kHalfRows * h + t / kUnits; row < end; row += kRowStep) {
          // The 16-byte unit in two 8-byte parts (the epilogue warps' 56 registers: whole
          // units spilled with silu).
#pragma unroll
          for (int part = 0; part < 2; ++part) {
            const uint32_t offset = Stage::swizzled(row, unit) + 8 * part;
            const uint2 dh = ptx::ld_shared_v2_b32(base + offset);
            const uint2 g = ptx::ld_shared_v2_b32(g_base + offset);
            const uint2 u = ptx::ld_shared_v2_b32(u_base + offset);
            const uint32_t hs[2] = {dh.x, dh.y}, gs[2] = {g.x, g.y}, us[2] = {u.x, u.y};
            uint32_t d_gate[2], d_up[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const float2 x = ptx::unpack_pair<Out>(hs[i]);
              const float2 gate = ptx::unpack_pair<Out>(gs[i]);
              const float2 up = ptx::unpack_pair<Out>(us[i]);
              const float2 lo = activate_and_grad<F::kAct>(gate.x);  // (act, act')
              const float2 hi = activate_and_grad<F::kAct>(gate.y);
              d_gate[i] = ptx::pack_pair<Out>(x.x * up.x * lo.y, x.y * up.y * hi.y);
              d_up[i] = ptx::pack_pair<Out>(x.x * lo.x, x.y * hi.x);
            }
            ptx::st_shared_v2_b32(base + offset, make_uint2(d_gate[0], d_gate[1]));
            ptx::st_shared_v2_b32(u_base + offset, make_uint2(d_up[0], d_up[1]));
          }
        }
        publish(barrier);
        if (issuer) {
          const ptx::TmaCoord<4> at{{to.col + 64 * c, to.row, to.batch, to.split}};
          ptx::tma_store(in.pre, ring.buffer[1] + h * kHalfBytes,
                         ptx::TmaCoord<4>{{at.c[0], at.c[1] + kHalfRows * h, at.c[2], at.c[3]}});
          if (h == halves - 1) ptx::tma_store(to.d, smem.buffer[c], at);
          StorePipeline::producer_commit();
          if (chunk_within(c + 1, to)) load_half(ring, loads, h, c + 1, to, in);
        }
      }
    }
  }

  // Issuer, a gated gradient's block of zeros (staged by hand_off_zeros): each chunk within D's
  // columns to D and, a half at a time (its map's boxes are half D's rows), to the up's
  // cotangent `d_up`.
  __device__ static void store_zero_grads(SharedStorage& smem, const StorePlan& to,
                                          const CUtensorMap* d_up) {
    const int halves = rows_within(to) > kHalfRows ? 2 : 1;
#pragma unroll 1
    for (int c = 0; chunk_within(c, to); ++c) {
      const ptx::TmaCoord<4> at{{to.col + 64 * c, to.row, to.batch, to.split}};
      ptx::tma_store(to.d, smem.buffer[c], at);
      for (int h = 0; h < halves; ++h) {
        ptx::tma_store(d_up, smem.buffer[c] + h * kHalfBytes,
                       ptx::TmaCoord<4>{{at.c[0], at.c[1] + kHalfRows * h, at.c[2], at.c[3]}});
      }
    }
    StorePipeline::producer_commit();
  }

  // The gated gradient's operands of the block at `to`: the kernel's maps, or the segment's
  // after its D's (the up's cotangent, then the gate's and the up's pre-activations).
  __device__ static Operands gated_grad_operands(const Operands& in, const StorePlan& to) {
    if constexpr (kSegmentMaps > 0) {
      static_assert(kSegmentMaps == 4, "D's, the up cotangent's and two pre-activations' maps");
      return Operands{in.args, to.d + 2, to.d + 3, to.d + 1, in.pre2};
    } else {
      return in;
    }
  }

  // Issuer: chunks `first`, `first` + `step`, ... to `map`, the i-th at D column to.col + 64 i
  // (those past D's columns left out), as one store group.
  __device__ static void store(const CUtensorMap* map, SharedStorage& smem, const StorePlan& to,
                               int first, int step) {
#pragma unroll 1
    for (int i = 0; first + i * step < kChunks; ++i) {
      if (64 * i >= to.cols - to.col) break;
      ptx::tma_store(map, smem.buffer[first + i * step],
                     ptx::TmaCoord<4>{{to.col + 64 * i, to.row, to.batch, to.split}});
    }
    StorePipeline::producer_commit();
  }

  // Every epilogue thread: the writes of this pass reach the TMA unit, then the issuer stores.
  __device__ static void publish(const NamedBarrier& barrier) {
    ptx::fence_proxy_async_shared();
    barrier.sync();
  }

  // One staged block: the fusion, the pre-activations first where asked for, then the output.
  __device__ static void finish(SharedStorage& smem, const StorePlan& to, const Operands& in,
                                const NamedBarrier& barrier, int t, AuxRing* ring,
                                AuxLoads& loads) {
    const bool issuer = t == 0;
    const FusionArgs& args = in.args;
    if constexpr (F::kKind == FusionKind::kGatedGrad) {
      // Handed over only with the pre-activations' ring (Kernel::kAuxRing); stores itself.
      gated_grad(smem, to, gated_grad_operands(in, to), t, barrier, *ring, loads);
      return;
    } else if constexpr (F::kGated) {
      if (args.store_pre) {  // the staged gate and up chunks as they are
        if (issuer) {
          // The segment's pre-activations' maps follow its D's (acquired in run()).
          store(kSegmentMaps > 0 ? to.d + 1 : in.pre, smem, to, 0, 2);
          store(kSegmentMaps > 0 ? to.d + 2 : in.pre2, smem, to, 1, 2);
          StorePipeline::producer_tail();
        }
        barrier.sync();  // their stores have read the chunks about to be rewritten
      }
      gate(smem, to, t);
    } else if constexpr (F::kKind == FusionKind::kActivationGrad) {
      // Handed over only with the pre-activation's ring (Kernel::offload).
      if (issuer) {
        for (int c = 0; c < kAuxSlots; ++c) load_aux(*ring, loads, c, to, in.aux);
      }
      transform<false, false, true>(smem, to, in, t, barrier, ring, loads);
    } else {
      constexpr bool kAct = F::kAct != Activation::kNone;
      const bool bias = args.bias != nullptr;
      const bool aux = ring != nullptr && args.aux;
      if (aux && issuer) {
        for (int c = 0; c < kAuxSlots; ++c) load_aux(*ring, loads, c, to, in.aux);
      }
      if (args.store_pre) {
        if (bias) {
          transform_biased<false, false>(smem, to, in, t, barrier, ring, loads);
          publish(barrier);
        }
        if (issuer) {
          store(in.pre, smem, to, 0, 1);
          StorePipeline::producer_tail();
        }
        barrier.sync();  // the pre-activations' stores have read the chunks
        if (aux) {
          transform<false, kAct, true>(smem, to, in, t, barrier, ring, loads);
        } else if constexpr (kAct) {
          transform<false, true, false>(smem, to, in, t, barrier, ring, loads);
        }
      } else if (aux) {
        if (bias) {
          transform_biased<kAct, true>(smem, to, in, t, barrier, ring, loads);
        } else {
          transform<false, kAct, true>(smem, to, in, t, barrier, ring, loads);
        }
      } else if (bias) {
        transform_biased<kAct, false>(smem, to, in, t, barrier, ring, loads);
      } else if constexpr (kAct) {
        transform<false, true, false>(smem, to, in, t, barrier, ring, loads);
      }
    }
    publish(barrier);
    if (issuer) store(to.d, smem, to, 0, F::kGated ? 2 : 1);
  }

  // Warps 1-3 of the producer warpgroup: finish the blocks of both consumer warpgroups, a pair
  // at a time while both are open (they hand over as many blocks, but on a CTA's last tile),
  // then the open one's alone, until both have closed. Both handoffs are
  // released before either is waited on, so that neither warpgroup waits for the other's
  // block to be staged, only for it to be handed over. `ring`: the residual's, with its slots'
  // barriers `loaded` (null where the kernel has none: no residual comes here then).
  __device__ static void run(SharedStorage (&staging)[2],
                             typename Handoff::SharedStorage (&slots)[2], const Operands& in,
                             AuxRing* ring, uint64_t (&loaded)[kAuxSlots]) {
    const int t = static_cast<int>(threadIdx.x) - kFirstThread;
    const NamedBarrier barrier{static_cast<uint32_t>(NamedBarrierId::kEpilogueWarps), kThreads};
    AuxLoads loads{loaded};
    const Handoff handoff[2] = {staged_handoff(0, kThreads), staged_handoff(1, kThreads)};
    bool open[2] = {true, true};
    // kSegmentMaps: the issuer's last acquired segment maps (an earlier kernel wrote them; the
    // tensormap proxy acquires each once per thread).
    const CUtensorMap* acquired = nullptr;
    while (open[0] || open[1]) {
      // The last pair's stores have read the buffers (the issuer's wait comes before its part
      // in the release, which the writer's acquire needs): each block's store overlapped the
      // next block's work.
      if (t == 0) StorePipeline::producer_tail();
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        if (open[w]) handoff[w].release();
      }
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        if (open[w]) handoff[w].wait();
      }
      // The slots stay the epilogue warps' until the next release: read each where it is used
      // (two held across a block's work would not fit in their registers).
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        if (!open[w]) continue;
        const Slot slot = slots[w].slot;
        if (slot.kind == Block::kEnd) {
          open[w] = false;
        } else if (slot.kind != Block::kSkip) {
          if constexpr (kSegmentMaps > 0) {
            if (t == 0 && slot.to.d != acquired) {
              // (A gated gradient reads and writes through all of the segment's maps.)
              const int maps = in.args.store_pre || F::kKind == FusionKind::kGatedGrad
                                   ? kSegmentMaps
                                   : 1;
              for (int i = 0; i < maps; ++i) ptx::fence_tensormap_acquire(slot.to.d + i);
              acquired = slot.to.d;
            }
          }
          if constexpr (F::kKind == FusionKind::kGatedGrad) {
            if (slot.kind == Block::kZeros) {
              if (t == 0) {
                store_zero_grads(staging[w], slot.to, gated_grad_operands(in, slot.to).pre);
              }
              continue;
            }
          }
          finish(staging[w], slot.to, in, barrier, t, ring, loads);
        }
      }
    }
  }
};

}  // namespace jax_tma
