// zen_ds CUDA kernels executed on the CPU: the test-only extension zen_ds_ops_cuda_emu.
//
// The emulation platform (zen_cuda_emu.h), then the very header the nvcc build compiles
// (zen_ops_cuda_kernels.cuh): zen::cuda::* here are the GPU launchers with every kernel run on
// the emulation's fibers, on CPU tensors. zen_ops_binding.cpp (built with -DZEN_CUDA_EMULATION)
// exposes them under the usual op names, plus the emulation's controls bound below.
#include "zen_cuda_emu.h"

#include "zen_ops_cuda_kernels.cuh"

#include <torch/csrc/utils/pybind.h>

#include <thread>

namespace zen {
namespace emu {
namespace {

// Kernels that test the emulation itself (emu_selftest): misuse it must report, and properties
// of its scheduler. Not GPU code: the real kernels live in zen_ops_cuda_kernels.cuh.

__global__ void selftest_deadlock_kernel()
{
    if (threadIdx.x % 32 == 0) __ballot_sync(0xffffffffu, 1);  // its lanes wait in __syncthreads
    else __syncthreads();
}

__global__ void selftest_divergent_kernel()
{
    if (threadIdx.x % 2) __syncwarp();
    else __ballot_sync(0xffffffffu, 1);
}

__global__ void selftest_not_in_mask_kernel() { __ballot_sync(1u, 1); }

__global__ void selftest_exited_lane_kernel()
{
    if (threadIdx.x % 32 == 31) return;
    __syncwarp();
}

// Thread 5 throws between two barriers: every thread's destructor must run (they unwind).
__global__ void selftest_throw_kernel(int64_t* unwound)
{
    struct Count {
        int64_t* n;
        ~Count() { ++*n; }  // one OS thread runs the block: no race
    } count{unwound};
    __syncthreads();
    TORCH_CHECK(threadIdx.x != 5, "thrown by thread 5");  // c10::Error: a backtrace on a fiber
    __syncthreads();
}

// Each thread reads its neighbour's shared slot, with or without the barrier that orders it
// after the neighbour's write. Without it the result depends on the order the threads run in.
__global__ void selftest_race_kernel(int64_t* out, bool synced)
{
    ZEN_SHARED_ARRAY(int32_t, slot);
    slot[threadIdx.x] = static_cast<int32_t>(threadIdx.x);
    if (synced) __syncthreads();
    const unsigned int neighbour = threadIdx.x ^ 1u;
    out[blockIdx.x * blockDim.x + threadIdx.x] =
        neighbour < blockDim.x ? slot[neighbour] : static_cast<int32_t>(neighbour);
}

// The built-in variables and collectives' results after every kind of switch: each thread counts
// the checks that held (the test wants all of them, in every thread of every block).
__global__ void selftest_indices_kernel(int64_t* out)
{
    const unsigned int t = threadIdx.x, b = blockIdx.x;
    const unsigned int lane = t % 32, first = t - lane;
    const unsigned int lanes = std::min(32u, blockDim.x - first);
    const unsigned int mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    auto same = [&] {
        return threadIdx.x == t && blockIdx.x == b && blockDim.x > t && gridDim.x > b;
    };
    int64_t ok = 0;
    for (int round = 0; round < 3; ++round) {
        __syncthreads();
        ok += same();
        __syncwarp(mask);
        ok += same();
        unsigned int thirds = 0;
        for (unsigned int l = 0; l < lanes; ++l) thirds |= (l % 3 == 0 ? 1u : 0u) << l;
        ok += __ballot_sync(mask, lane % 3 == 0) == thirds && same();
        unsigned int quarter = 0;
        for (unsigned int l = lane % 4; l < lanes; l += 4) quarter |= 1u << l;
        ok += __match_any_sync(mask, static_cast<int64_t>(lane % 4) - 2) == quarter && same();
        ok += __any_sync(mask, lane == lanes - 1) == 1 && __all_sync(mask, lane < 99) == 1;
    }
    out[b * blockDim.x + t] = ok;
}

// Recursion far deeper than a fiber's stack: the process dies of SIGSEGV, after a line that names
// the kernel and the thread (the test runs it in a subprocess).
__device__ int64_t selftest_deep(int64_t n)
{
    volatile char frame[1024];
    frame[0] = static_cast<char>(n);
    return n == 0 ? frame[0] : selftest_deep(n - 1) + frame[0];
}

__global__ void selftest_overflow_kernel(int64_t* out)
{
    out[threadIdx.x] = selftest_deep(1 << 20);
}

__global__ void selftest_noop_kernel() {}

// Runs one self-test; (the kernel's output, the launch's error or "").
std::tuple<std::vector<int64_t>, std::string> selftest(const std::string& name, int64_t grid,
                                                       int64_t block)
{
    std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(1, grid * block)), -1);
    try {
        if (name == "deadlock") {
            ZEN_LAUNCH(grid, block, 0, 0, selftest_deadlock_kernel)();
        } else if (name == "divergent") {
            ZEN_LAUNCH(grid, block, 0, 0, selftest_divergent_kernel)();
        } else if (name == "not_in_mask") {
            ZEN_LAUNCH(grid, block, 0, 0, selftest_not_in_mask_kernel)();
        } else if (name == "exited_lane") {
            ZEN_LAUNCH(grid, block, 0, 0, selftest_exited_lane_kernel)();
        } else if (name == "throw") {
            out.assign(1, 0);
            ZEN_LAUNCH(grid, block, 0, 0, selftest_throw_kernel)(out.data());
        } else if (name == "race" || name == "race_synced") {
            ZEN_LAUNCH(grid, block, block * sizeof(int32_t), 0, selftest_race_kernel)(
                out.data(), name == "race_synced");
        } else if (name == "indices") {
            ZEN_LAUNCH(grid, block, 0, 0, selftest_indices_kernel)(out.data());
        } else if (name == "concurrent") {
            // four OS threads launching at once, each on its own fibers: out sums their counts
            std::vector<std::vector<int64_t>> outs(4, std::vector<int64_t>(out.size(), 0));
            std::vector<std::string> errors(outs.size());
            std::vector<std::thread> threads;
            for (size_t i = 0; i < outs.size(); ++i) {
                threads.emplace_back([&, i] {
                    try {
                        ZEN_LAUNCH(grid, block, 0, 0, selftest_indices_kernel)(outs[i].data());
                    } catch (const c10::Error& e) {
                        errors[i] = e.what_without_backtrace();
                    }
                });
            }
            for (std::thread& thread : threads) thread.join();
            for (const std::string& error : errors) TORCH_CHECK(error.empty(), error);
            for (size_t j = 0; j < out.size(); ++j) {
                out[j] = 0;
                for (const auto& o : outs) out[j] += o[j];
            }
        } else if (name == "overflow") {
            ZEN_LAUNCH(grid, block, 0, 0, selftest_overflow_kernel)(out.data());
        } else if (name == "too_much_shared") {
            ZEN_LAUNCH(grid, block, zen_emu::kMaxSharedBytes + 1, 0, selftest_noop_kernel)();
        } else if (name == "noop") {
            ZEN_LAUNCH(grid, block, 0, 0, selftest_noop_kernel)();
        } else {
            throw std::invalid_argument("zen_ds emulation: unknown self-test '" + name + "'");
        }
    } catch (const c10::Error& e) {
        return {out, e.what_without_backtrace()};
    }
    return {out, ""};
}

}  // namespace

void bind(pybind11::module_& m)
{
    m.def("emu_set_fault", &zen_emu::set_fault,
          "'nonatomic': atomics become plain read-modify-writes under the worst lockstep schedule; "
          "'warp_prefix_skips_warp0': the partition's per-warp prefix skips warp 0 (an off-by-one); "
          "'scan_off_by_one': the block scan's first shuffle step leaves out lane 0; "
          "'none': correct again");
    m.def("emu_launch_counts", &zen_emu::launch_counts, "kernel name -> launches since the reset");
    m.def("emu_reset_launch_counts", &zen_emu::reset_launch_counts);
    m.def("emu_config", [] {
        return std::map<std::string, int64_t>{{"threads", zen::cuda::kThreads},
                                              {"max_grid", zen::cuda::kMaxGrid}};
    }, "block size and grid cap the kernels were compiled with");
    m.def("emu_selftest", &selftest, pybind11::arg("name"), pybind11::arg("grid"),
          pybind11::arg("block"),
          "run one of the emulation's own test kernels: (its output, the launch's error or '')");
}

}  // namespace emu
}  // namespace zen
