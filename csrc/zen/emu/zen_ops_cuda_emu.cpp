// zen_ds CUDA kernels executed on the CPU: the test-only extension zen_ds_ops_cuda_emu.
//
// The emulation platform (zen_cuda_emu.h), then the very header the nvcc build compiles
// (zen_ops_cuda_kernels.cuh): zen::cuda::* here are the GPU launchers with every kernel run on CPU
// threads, on CPU tensors. zen_ops_binding.cpp (built with -DZEN_CUDA_EMULATION) exposes them under
// the usual op names, plus the emulation's controls bound below.
#include "zen_cuda_emu.h"

#include "zen_ops_cuda_kernels.cuh"

#include <torch/csrc/utils/pybind.h>

namespace zen {
namespace emu {

void bind(pybind11::module_& m)
{
    m.def("emu_set_fault", &zen_emu::set_fault,
          "'nonatomic': atomics become plain read-modify-writes under the worst lockstep schedule; "
          "'warp_prefix_skips_warp0': the partition's per-warp prefix skips warp 0 (an off-by-one); "
          "'none': correct again");
    m.def("emu_launch_counts", &zen_emu::launch_counts, "kernel name -> launches since the reset");
    m.def("emu_reset_launch_counts", &zen_emu::reset_launch_counts);
    m.def("emu_config", [] {
        return std::map<std::string, int64_t>{{"threads", zen::cuda::kThreads},
                                              {"max_grid", zen::cuda::kMaxGrid}};
    }, "block size and grid cap the kernels were compiled with");
}

}  // namespace emu
}  // namespace zen
