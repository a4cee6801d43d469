// Test kernel of tensor maps in global memory edited on the device (ptx/tensormap.cuh), the
// mechanism of grouped / ragged GEMM: one host-encoded template, one edited copy per group.
// See TensormapReplaceArgs in primitives_test.h.
#include "pipeline/barrier_wait.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tensormap.cuh"
#include "ptx/tma.cuh"
#include "testing/kernel_util.cuh"
#include "testing/primitives_test.h"

namespace jax_tma::testing {
namespace {

constexpr int kThreads = 128;

struct GroupShape {
  int32_t offset;  // elements from the base
  int32_t rows;
  int32_t cols;
  int32_t row_stride;  // elements
};

// One thread: this CTA's slot becomes the template with group g's address, dims and stride,
// published to the tensormap proxy and acquired before the first TMA through it.
__device__ void edit_map(CUtensorMap* slot, const CUtensorMap* map_template,
                         const TensormapReplaceArgs& a, const GroupShape& g) {
  ptx::tensormap_copy(slot, map_template);
  ptx::tensormap_replace_global_address(slot, a.base + static_cast<size_t>(g.offset) *
                                                           a.element_bytes);
  ptx::tensormap_replace_global_dim<0>(slot, static_cast<uint32_t>(g.cols));
  ptx::tensormap_replace_global_dim<1>(slot, static_cast<uint32_t>(g.rows));
  ptx::tensormap_replace_global_stride<0>(slot, static_cast<uint64_t>(g.row_stride) *
                                                    a.element_bytes);
  ptx::fence_tensormap_release();
  ptx::fence_tensormap_acquire(slot);
}

__global__ void tensormap_replace_kernel(const __grid_constant__ CUtensorMap map_template,
                                         TensormapReplaceArgs a) {
  extern __shared__ uint8_t raw[];
  uint8_t* buf = align_1024(raw);
  __shared__ uint64_t bar;
  const int group = blockIdx.x;
  CUtensorMap* slot = a.workspace + group;
  if (threadIdx.x == 0) {
    ptx::mbarrier_init(&bar, 1);
    ptx::fence_mbarrier_init();
    const int32_t* g = a.groups + 4 * group;
    edit_map(slot, &map_template, a, GroupShape{g[0], g[1], g[2], g[3]});
    ptx::mbarrier_arrive_expect_tx(&bar, a.box_bytes);
    ptx::tma_load_2d(buf, slot, &bar, 0, 0);
  }
  __syncthreads();
  if (!wait_parity_bounded(&bar, 0, a.timeout_cycles)) {
    if (threadIdx.x == 0) report_timeout(a.timeouts);
    return;
  }
  dump_smem(a.images + static_cast<size_t>(group) * a.box_bytes, buf, a.box_bytes);
}

}  // namespace

cudaError_t launch_tensormap_replace(const TensormapReplaceArgs& a, cudaStream_t stream) {
  return launch_plain(tensormap_replace_kernel, a.num_groups, kThreads, a.box_bytes + 1024,
                      stream, *a.map_template, a);
}

}  // namespace jax_tma::testing
