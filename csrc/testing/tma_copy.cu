// Persistent TMA load -> TMA store copy kernel; see tma_copy.h.
#include "pipeline/pipeline_state.cuh"
#include "pipeline/tma_pipeline.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "testing/kernel_util.cuh"
#include "testing/tma_copy.h"

namespace jax_tma::testing {
namespace {

struct CopyTiles {
  int tiles_per_row;
  int num_tiles;
};

// One thread drives every copy of the CTA: all of them are asynchronous, so the loads of the
// next kStages - kStoresInFlight tiles and the stores of the last kStoresInFlight tiles are in
// flight together. The full barriers of PipelineTmaAsync say when a load has landed; a stage
// is free again once the store that read it has finished reading (tma_store_wait_read), which
// the same thread observes, so the ring's empty barriers go unused.
template <int kStages>
__global__ void tma_copy_kernel(const __grid_constant__ CUtensorMap map_in,
                                const __grid_constant__ CUtensorMap map_out, CopyTiles tiles) {
  constexpr int kStoresInFlight = kStages / 2;
  constexpr int kLoadsAhead = kStages - kStoresInFlight;
  using Pipeline = PipelineTmaAsync<kStages>;
  extern __shared__ uint8_t raw[];
  __shared__ typename Pipeline::SharedStorage barriers;
  if (threadIdx.x != 0) return;
  uint8_t* ring = align_1024(raw);
  ptx::prefetch_tensormap(&map_in);
  ptx::prefetch_tensormap(&map_out);
  Pipeline::init(barriers, 1);
  ptx::fence_mbarrier_init();
  Pipeline pipeline{barriers};

  const int my_tiles = (tiles.num_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
  auto corner = [&](int local) {
    const int tile = blockIdx.x + local * gridDim.x;
    return ptx::TmaCoord<2>{{static_cast<int32_t>(tile % tiles.tiles_per_row * kTmaCopyBoxCols),
                             static_cast<int32_t>(tile / tiles.tiles_per_row * kTmaCopyBoxRows)}};
  };
  auto load = make_producer_start_state<kStages>();
  auto store = make_consumer_start_state<kStages>();
  int loaded = 0;
  auto issue_load = [&] {
    uint64_t* full = pipeline.producer_expect_tx(load, kTmaCopyTileBytes);
    ptx::tma_load(ring + load.index * kTmaCopyTileBytes, &map_in, full, corner(loaded));
    ++loaded;
    ++load;
  };
  while (loaded < my_tiles && loaded < kLoadsAhead) issue_load();
  for (int j = 0; j < my_tiles; ++j, ++store) {
    pipeline.consumer_wait(store);
    ptx::tma_store(&map_out, ring + store.index * kTmaCopyTileBytes, corner(j));
    ptx::tma_store_commit_group();
    if (loaded < my_tiles) {
      // The next load's stage was last read by the store kStoresInFlight groups back.
      ptx::tma_store_wait_read<kStoresInFlight>();
      issue_load();
    }
  }
  ptx::tma_store_wait_all<0>();
}

template <int kStages>
cudaError_t launch_stages(const TmaCopyArgs& a, cudaStream_t stream) {
  return launch_plain(tma_copy_kernel<kStages>, a.ctas, 32, tma_copy_smem_bytes(kStages), stream,
                      *a.map_in, *a.map_out, CopyTiles{a.tiles_per_row, a.num_tiles});
}

}  // namespace

uint32_t tma_copy_smem_bytes(int stages) { return stages * kTmaCopyTileBytes + 1024; }

cudaError_t launch_tma_copy(const TmaCopyArgs& a, cudaStream_t stream) {
  switch (a.stages) {
    case 4: return launch_stages<4>(a, stream);
    case 6: return launch_stages<6>(a, stream);
    case 12: return launch_stages<12>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_tma::testing
