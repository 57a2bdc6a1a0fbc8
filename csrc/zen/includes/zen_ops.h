// zen_ds ops: declarations shared by the binding, the CPU kernels and the CUDA kernels.
//
// Callers (zen_ds/ops/compiled.py) pass contiguous tensors: ids as int64, values viewed as
// [k, row_numel]. Every size and index is 64-bit. Semantics are those of zen_ds/ops/torch_ops.py.
// bitmap_decode's `count`: the number of set bits when the caller knows it (the output is then
// sized without reading the device), else -1.
#pragma once

// ATen/core/Tensor.h, not ATen/ATen.h: every source includes just the operator headers it calls
// (ATen/ops/*.h), which keeps the JIT build that users wait for on first use short.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace zen {

struct PermArgs {
    int64_t num_rows;
    int64_t multiplier;
    int64_t inverse;
    int64_t offset;
};

namespace cpu {
at::Tensor permute(const at::Tensor& rows, const PermArgs& perm, bool inverse);
at::Tensor nonzero_rows(const at::Tensor& values);
std::tuple<at::Tensor, at::Tensor, at::Tensor> partition(const at::Tensor& rows,
                                                         const at::Tensor& values,
                                                         const PermArgs& perm,
                                                         int64_t world_size,
                                                         bool int32_ids);
std::tuple<at::Tensor, at::Tensor> aggregate(const at::Tensor& offsets,
                                             const at::Tensor& values,
                                             at::ScalarType accum_dtype,
                                             int64_t terms);
std::tuple<at::Tensor, at::Tensor, at::Tensor> aggregate_bitmap(const at::Tensor& offsets,
                                                                const at::Tensor& values,
                                                                at::ScalarType accum_dtype,
                                                                int64_t universe, int64_t terms);
at::Tensor bitmap_encode(const at::Tensor& offsets, int64_t universe);
at::Tensor bitmap_decode(const at::Tensor& bitmap, int64_t universe, int64_t count);
void scatter_rows(at::Tensor& out, const at::Tensor& rows, const at::Tensor& values);
void scatter_shard(at::Tensor& out, const at::Tensor& index, const at::Tensor& values, bool bitmap,
                   int64_t universe, int64_t shard_start, const PermArgs& perm);
}  // namespace cpu

#if defined(ZEN_WITH_CUDA) || defined(ZEN_CUDA_EMULATION)  // emulation: csrc/zen/emu
namespace cuda {
at::Tensor permute(const at::Tensor& rows, const PermArgs& perm, bool inverse);
at::Tensor nonzero_rows(const at::Tensor& values);
std::tuple<at::Tensor, at::Tensor, at::Tensor> partition(const at::Tensor& rows,
                                                         const at::Tensor& values,
                                                         const PermArgs& perm,
                                                         int64_t world_size,
                                                         bool int32_ids);
std::tuple<at::Tensor, at::Tensor> aggregate(const at::Tensor& offsets,
                                             const at::Tensor& values,
                                             at::ScalarType accum_dtype,
                                             int64_t terms);
std::tuple<at::Tensor, at::Tensor, at::Tensor> aggregate_bitmap(const at::Tensor& offsets,
                                                                const at::Tensor& values,
                                                                at::ScalarType accum_dtype,
                                                                int64_t universe, int64_t terms);
at::Tensor bitmap_encode(const at::Tensor& offsets, int64_t universe);
at::Tensor bitmap_decode(const at::Tensor& bitmap, int64_t universe, int64_t count);
void scatter_rows(at::Tensor& out, const at::Tensor& rows, const at::Tensor& values);
void scatter_shard(at::Tensor& out, const at::Tensor& index, const at::Tensor& values, bool bitmap,
                   int64_t universe, int64_t shard_start, const PermArgs& perm);
}  // namespace cuda
#endif

}  // namespace zen
