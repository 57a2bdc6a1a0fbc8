// zen_ds CUDA kernels: the nvcc platform for csrc/zen/includes/zen_ops_cuda_kernels.cuh, which holds
// the kernels and their launchers (the CPU emulation in csrc/zen/emu compiles the same header).
#include "zen_ops.h"

// c10 stream/guard headers only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers that a
// bare nvcc toolkit lacks. c10::cuda::getCurrentCUDAStream is what at::cuda::getCurrentCUDAStream
// resolves to.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define ZEN_LAUNCH(grid, block, shmem, stream, ...) __VA_ARGS__<<<grid, block, shmem, stream>>>
#define ZEN_SHARED_ARRAY(type, name) extern __shared__ type name[]
#define ZEN_DEVICE_GUARD(tensor) const c10::cuda::OptionalCUDAGuard zen_device_guard((tensor).device())
#define ZEN_STREAM() c10::cuda::getCurrentCUDAStream()
#define ZEN_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()
#define ZEN_ON_DEVICE(tensor) (tensor).is_cuda()
using ZenStream = cudaStream_t;

#include "zen_ops_cuda_kernels.cuh"
