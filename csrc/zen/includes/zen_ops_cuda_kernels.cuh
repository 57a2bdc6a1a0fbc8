// zen_ds CUDA kernels and their host launchers: one source for the GPU and for the CPU emulation.
//
// Included by csrc/zen/cuda/zen_ops_cuda.cu (nvcc: real kernels on the current stream) and by
// csrc/zen/emu/zen_ops_cuda_emu.cpp (host compiler: the same kernels run on CPU threads, see
// csrc/zen/emu/zen_cuda_emu.h), so the tests run exactly the code the GPU runs. The includer
// provides the platform before including this file:
//
//   ZEN_LAUNCH(grid, block, shmem, stream, kernel)(args...)   launch `kernel`
//   ZEN_SHARED_ARRAY(type, name)                              the block's dynamic shared memory
//   ZEN_DEVICE_GUARD(tensor)   ZEN_STREAM()   ZenStream       device guard, current stream
//   ZEN_LAUNCH_CHECK()                                        raise on a failed launch
//   ZEN_ON_DEVICE(tensor)                                     the tensor lives on the kernels' device
//
// and the CUDA built-ins the kernels use (threadIdx, blockIdx, blockDim, gridDim, __syncthreads,
// atomicAdd, atomicOr, __any_sync, __match_any_sync, __popc, __ffs, uint2, uint4).
//
// Every launch goes to the current stream; sizes and indices are 64-bit. The owner partition is a
// stable counting sort (per-block histogram, exclusive scan, scatter with warp-match ranks):
// lossless by construction, no hash table and no "empty" marker.
#pragma once

#include "zen_ops.h"
#include "zen_permute.h"

#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#ifndef ZEN_LAUNCH
#error "include zen_ops_cuda_kernels.cuh from zen_ops_cuda.cu or the emulation, which define the platform"
#endif

// Mutation point: the first warp counted in the partition's per-warp prefix. The GPU build
// compiles the correct 0; the emulation makes it a run-time switch (emu_set_fault
// "warp_prefix_skips_warp0": 1, an off-by-one) to show that the tests catch such a bug.
#ifndef ZEN_MUTATION_WARP_PREFIX_FIRST
#define ZEN_MUTATION_WARP_PREFIX_FIRST 0
#endif

// Block size and grid cap. The emulation may shrink the grid cap so that small test inputs wrap
// around every grid-stride loop; the GPU build uses the defaults.
#ifndef ZEN_CUDA_THREADS
#define ZEN_CUDA_THREADS 256
#endif
#ifndef ZEN_CUDA_MAX_GRID
#define ZEN_CUDA_MAX_GRID (1 << 16)
#endif

namespace zen {
namespace cuda {
namespace {

constexpr int kThreads = ZEN_CUDA_THREADS;
constexpr int kWarps = kThreads / 32;
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 1024 threads");
constexpr int64_t kMaxGrid = ZEN_CUDA_MAX_GRID;  // grid-stride kernels never need more blocks than this
constexpr int64_t kMaxPartitionWorld = 1024;  // shared-memory histograms: kWarps * n ints

int64_t grid_for(int64_t work)
{
    return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, kMaxGrid));
}

Permutation make_perm(const PermArgs& a, int64_t world_size)
{
    return make_permutation(static_cast<uint64_t>(a.num_rows), static_cast<uint64_t>(a.multiplier),
                            static_cast<uint64_t>(a.inverse), static_cast<uint64_t>(a.offset),
                            static_cast<uint64_t>(world_size));
}

void check_ids(const at::Tensor& t, const char* what)
{
    TORCH_CHECK(ZEN_ON_DEVICE(t) && t.scalar_type() == at::kLong && t.is_contiguous(), what,
                " must be a contiguous int64 CUDA tensor");
}

// Reads a device-side error flag (one small synchronising copy) and raises with `message`.
void raise_if_flagged(const at::Tensor& flag, const std::string& message)
{
    TORCH_CHECK(flag.item<int32_t>() == 0, message);
}

__device__ __forceinline__ int64_t global_thread() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------- permute / unpermute

__global__ void permute_kernel(const uint64_t* __restrict__ src, uint64_t* __restrict__ dst, int64_t n,
                               Permutation p, bool inverse, int32_t* bad)
{
    for (int64_t i = global_thread(); i < n; i += grid_stride()) {
        uint64_t x = src[i];
        if (x >= p.rows.d) {
            *bad = 1;
            x = 0;
        }
        dst[i] = inverse ? unpermute_one(x, p) : permute_one(x, p);
    }
}

// ---------------------------------------------------------------- nonzero rows

// Raw-bit test: every element whose bits are not those of +0.0 counts (NaN, denormals and -0.0:
// a -0.0 row is synced so that a row that is -0.0 on every rank sums to -0.0).
template <typename Bits>
__global__ void row_flags_kernel(const Bits* __restrict__ data, int64_t rows, int64_t width,
                                 uint8_t* __restrict__ flags)
{
    constexpr Bits mask = static_cast<Bits>(~Bits(0));
    if (width == 1) {
        for (int64_t i = global_thread(); i < rows; i += grid_stride())
            flags[i] = (data[i] & mask) != 0;
        return;
    }
    const int lane = threadIdx.x & 31;
    const int64_t warp = global_thread() >> 5;
    const int64_t warps = grid_stride() >> 5;
    for (int64_t r = warp; r < rows; r += warps) {  // uniform per warp: __any_sync is safe
        const Bits* row = data + r * width;
        Bits any = 0;
        for (int64_t j = lane; j < width; j += 32) any |= row[j] & mask;
        const bool nonzero = __any_sync(0xffffffffu, any != 0);
        if (lane == 0) flags[r] = nonzero;
    }
}

__global__ void compact_kernel(const uint8_t* __restrict__ flags, const int64_t* __restrict__ inclusive,
                               int64_t n, int64_t* __restrict__ out)
{
    for (int64_t i = global_thread(); i < n; i += grid_stride())
        if (flags[i]) out[inclusive[i] - 1] = i;
}

// ---------------------------------------------------------------- partition

// Pass 1: owner and shard offset of each row, per-block histogram written owner-major.
__global__ void owner_hist_kernel(const uint64_t* __restrict__ ids, int64_t k, Permutation p,
                                  int32_t* __restrict__ owner, int64_t* __restrict__ shard_off,
                                  int64_t* __restrict__ hist, int32_t* bad)
{
    ZEN_SHARED_ARRAY(int32_t, block_hist);  // [world_size]
    const int64_t n = static_cast<int64_t>(p.world_size);
    for (int64_t o = threadIdx.x; o < n; o += blockDim.x) block_hist[o] = 0;
    __syncthreads();
    const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
    if (i < k) {
        uint64_t x = ids[i];
        if (x >= p.rows.d) {
            *bad = 1;
            x = 0;
        }
        uint64_t so;
        const uint64_t o = owner_of(permute_one(x, p), p, &so);
        owner[i] = static_cast<int32_t>(o);
        shard_off[i] = static_cast<int64_t>(so);
        atomicAdd(&block_hist[o], 1);
    }
    __syncthreads();
    for (int64_t o = threadIdx.x; o < n; o += blockDim.x)
        hist[o * gridDim.x + blockIdx.x] = block_hist[o];
}

// Pass 2: stable destination of each row = scanned base of (owner, block) + rank inside the block
// among rows with the same owner (warp match + per-warp counts), then write the shard offset.
template <typename Id>
__global__ void partition_scatter_kernel(const int32_t* __restrict__ owner,
                                         const int64_t* __restrict__ shard_off, int64_t k,
                                         int64_t n, const int64_t* __restrict__ base,
                                         int64_t* __restrict__ dest, Id* __restrict__ out_off)
{
    ZEN_SHARED_ARRAY(int32_t, warp_hist);  // [kWarps][n]
    for (int64_t j = threadIdx.x; j < kWarps * n; j += blockDim.x) warp_hist[j] = 0;
    __syncthreads();
    const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
    const bool valid = i < k;
    const int32_t o = valid ? owner[i] : static_cast<int32_t>(n);  // sentinel groups the tail
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const unsigned peers = __match_any_sync(0xffffffffu, o);
    const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
    if (valid && rank_in_warp == 0) warp_hist[warp * n + o] = __popc(peers);
    __syncthreads();
    if (!valid) return;
    int64_t rank = rank_in_warp;
    for (int w = ZEN_MUTATION_WARP_PREFIX_FIRST; w < warp; ++w) rank += warp_hist[w * n + o];
    const int64_t d = base[o * int64_t(gridDim.x) + blockIdx.x] + rank;
    dest[i] = d;
    out_off[d] = static_cast<Id>(shard_off[i]);
}

// Row copy dst[index[i]] = src[i] (or dst[i] = src[index[i]] when gather), `units` Units per row.
template <typename Unit>
__global__ void copy_rows_kernel(const Unit* __restrict__ src, Unit* __restrict__ dst,
                                 const int64_t* __restrict__ index, int64_t k, int64_t units)
{
    const int64_t total = k * units;
    for (int64_t t = global_thread(); t < total; t += grid_stride()) {
        const int64_t i = t / units;
        const int64_t u = t - i * units;
        dst[index[i] * units + u] = src[t];
    }
}

// Copy k rows of row_bytes with the widest unit the sizes and pointers allow.
void copy_rows(const void* src, void* dst, const int64_t* index, int64_t k, int64_t row_bytes,
               ZenStream stream)
{
    if (k == 0 || row_bytes == 0) return;
    const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                            static_cast<uintptr_t>(row_bytes);
    const int64_t grid = grid_for(k * row_bytes / 4);
#define ZEN_COPY(Unit)                                                                   \
    ZEN_LAUNCH(grid, kThreads, 0, stream, copy_rows_kernel<Unit>)(                       \
        static_cast<const Unit*>(src), static_cast<Unit*>(dst), index, k,                 \
        row_bytes / int64_t(sizeof(Unit)))
    if (align % 16 == 0) ZEN_COPY(uint4);
    else if (align % 8 == 0) ZEN_COPY(uint2);
    else if (align % 4 == 0) ZEN_COPY(uint32_t);
    else if (align % 2 == 0) ZEN_COPY(uint16_t);
    else ZEN_COPY(uint8_t);
#undef ZEN_COPY
    ZEN_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- aggregate

__global__ void segment_heads_kernel(const int64_t* __restrict__ sorted, int64_t k,
                                     int64_t* __restrict__ head)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride())
        head[i] = (i == 0 || sorted[i] != sorted[i - 1]) ? 1 : 0;
}

__global__ void segment_starts_kernel(const int64_t* __restrict__ sorted, const int64_t* __restrict__ head,
                                      const int64_t* __restrict__ seg, int64_t k,
                                      int64_t* __restrict__ starts, int64_t* __restrict__ unique)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride()) {
        if (head[i]) {
            starts[seg[i] - 1] = i;
            unique[seg[i] - 1] = sorted[i];
        }
        if (i == k - 1) starts[seg[i]] = k;
    }
}

// Value -> accumulator like torch's values.to(accum_dtype): reduced floats widen exactly.
template <typename Acc, typename T>
__device__ __forceinline__ Acc to_acc(T v)
{
    if constexpr (std::is_same<T, double>::value) return static_cast<Acc>(v);
    else return static_cast<Acc>(static_cast<float>(v));
}

// One thread per (segment, column): sums the segment's rows in input order (stable sort), so the
// result is deterministic. A segment holds at most one row per rank.
template <typename T, typename Acc>
__global__ void segment_sum_kernel(const T* __restrict__ values, const int64_t* __restrict__ order,
                                   const int64_t* __restrict__ starts, int64_t u, int64_t width,
                                   int64_t terms, Acc* __restrict__ sums)
{
    const int64_t total = u * width;
    for (int64_t t = global_thread(); t < total; t += grid_stride()) {
        const int64_t s = t / width;
        const int64_t j = t - s * width;
        // -0.0 is the additive identity (a sum of -0.0 stays -0.0); a row fewer than `terms`
        // contributors sent also sums the others' +0.0, so it starts from +0.0.
        Acc acc = starts[s + 1] - starts[s] < terms ? Acc(0) : -Acc(0);
        for (int64_t m = starts[s]; m < starts[s + 1]; ++m)
            acc += to_acc<Acc>(values[order[m] * width + j]);
        sums[t] = acc;
    }
}

// ---------------------------------------------------------------- bitmap codec

// A little-endian uint8 bitmap and a little-endian uint32 bitmap have the same bytes, so bits
// are set with 32-bit atomicOr (offsets may repeat or arrive unsorted).
__global__ void bitmap_set_kernel(const int64_t* __restrict__ off, int64_t k, int64_t universe,
                                  unsigned int* __restrict__ words, int32_t* bad)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride()) {
        const int64_t p = off[i];
        if (p < 0 || p >= universe) {
            *bad = 1;
            continue;
        }
        atomicOr(words + (p >> 5), 1u << (p & 31));
    }
}

__device__ __forceinline__ unsigned int masked_byte(const uint8_t* bytes, int64_t b, int64_t nbits)
{
    unsigned int v = bytes[b];
    const int64_t valid = nbits - b * 8;
    if (valid < 8) v &= (1u << valid) - 1u;
    return v;
}

// bitmap_decode works on 32-bit words assembled from bytes (the bitmap may start at any byte
// address): one int32 count per word instead of an int64 per byte, so the count, scan and re-read
// move about a sixth of the bytes they did. Byte j of word w holds bits 8j..8j+7: position
// w * 32 + bit, the same as (4w + j) * 8 + bit in byte order.
__device__ __forceinline__ unsigned int masked_word(const uint8_t* bytes, int64_t w, int64_t nbytes,
                                                    int64_t nbits)
{
    unsigned int v = 0;
    for (int j = 0; j < 4; ++j) {
        const int64_t b = w * 4 + j;
        if (b < nbytes) v |= masked_byte(bytes, b, nbits) << (8 * j);
    }
    return v;
}

__global__ void word_popcount_kernel(const uint8_t* __restrict__ bytes, int64_t nbytes, int64_t nbits,
                                     int64_t nwords, int32_t* __restrict__ counts)
{
    for (int64_t w = global_thread(); w < nwords; w += grid_stride())
        counts[w] = __popc(masked_word(bytes, w, nbytes, nbits));
}

__global__ void bitmap_positions_kernel(const uint8_t* __restrict__ bytes, int64_t nbytes,
                                        int64_t nbits, int64_t nwords,
                                        const int64_t* __restrict__ inclusive,
                                        int64_t* __restrict__ out)
{
    for (int64_t w = global_thread(); w < nwords; w += grid_stride()) {
        unsigned int v = masked_word(bytes, w, nbytes, nbits);
        int64_t d = inclusive[w] - __popc(v);
        while (v) {
            out[d++] = w * 32 + (__ffs(v) - 1);
            v &= v - 1u;
        }
    }
}

__global__ void check_range_kernel(const int64_t* __restrict__ ids, int64_t k, int64_t limit, int32_t* bad)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride())
        if (ids[i] < 0 || ids[i] >= limit) *bad = 1;
}

// Rows of a pulled shard: pi^-1(shard_start + p) for every set bit p of the bitmap, in bit order.
__global__ void shard_rows_bitmap_kernel(const uint8_t* __restrict__ bytes, int64_t nbytes,
                                         int64_t nbits, int64_t nwords,
                                         const int64_t* __restrict__ inclusive,
                                         uint64_t shard_start, Permutation p,
                                         int64_t* __restrict__ rows)
{
    for (int64_t w = global_thread(); w < nwords; w += grid_stride()) {
        unsigned int v = masked_word(bytes, w, nbytes, nbits);
        int64_t d = inclusive[w] - __popc(v);
        while (v) {
            const uint64_t pos = shard_start + static_cast<uint64_t>(w * 32 + (__ffs(v) - 1));
            rows[d++] = static_cast<int64_t>(unpermute_one(pos, p));
            v &= v - 1u;
        }
    }
}

// Rows of a pulled COO shard: pi^-1(shard_start + off[i]); flags offsets outside the universe.
template <typename Id>
__global__ void shard_rows_coo_kernel(const Id* __restrict__ off, int64_t k, int64_t universe,
                                      uint64_t shard_start, Permutation p, int64_t* __restrict__ rows,
                                      int32_t* bad)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride()) {
        const int64_t o = static_cast<int64_t>(off[i]);
        if (o < 0 || o >= universe) {
            *bad = 1;
            rows[i] = 0;
            continue;
        }
        rows[i] = static_cast<int64_t>(unpermute_one(shard_start + static_cast<uint64_t>(o), p));
    }
}

at::Tensor error_flag(const at::Tensor& like)
{
    return at::zeros({1}, like.options().dtype(at::kInt));
}

}  // namespace

at::Tensor permute(const at::Tensor& rows, const PermArgs& perm, bool inverse)
{
    check_ids(rows, "permute input");
    ZEN_DEVICE_GUARD(rows);
    const int64_t n = rows.numel();
    at::Tensor out = at::empty_like(rows);
    if (n == 0) return out;
    at::Tensor bad = error_flag(rows);
    auto stream = ZEN_STREAM();
    ZEN_LAUNCH(grid_for(n), kThreads, 0, stream, permute_kernel)(
        reinterpret_cast<const uint64_t*>(rows.const_data_ptr<int64_t>()),
        reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>()), n, make_perm(perm, 1), inverse,
        bad.data_ptr<int32_t>());
    ZEN_LAUNCH_CHECK();
    raise_if_flagged(bad, std::string("zen_ds permute: every id must lie in [0, num_rows=") +
                              std::to_string(perm.num_rows) + ")");
    return out;
}

at::Tensor nonzero_rows(const at::Tensor& values)
{
    TORCH_CHECK(ZEN_ON_DEVICE(values) && values.is_contiguous() && values.dim() >= 1 && values.dim() <= 2,
                "zen_ds nonzero_rows: expected a contiguous 1-D or 2-D CUDA tensor");
    ZEN_DEVICE_GUARD(values);
    auto stream = ZEN_STREAM();
    const int64_t rows = values.size(0);
    const int64_t width = values.dim() == 1 ? 1 : values.size(1);
    auto id_opts = values.options().dtype(at::kLong);
    if (rows == 0) return at::empty({0}, id_opts);
    if (width == 0) return at::empty({0}, id_opts);
    at::Tensor flags = at::empty({rows}, values.options().dtype(at::kByte));
    const int64_t grid = width == 1 ? grid_for(rows) : grid_for(rows * 32);
    switch (values.element_size()) {
#define ZEN_FLAGS(Bits)                                                                  \
    ZEN_LAUNCH(grid, kThreads, 0, stream, row_flags_kernel<Bits>)(                       \
        static_cast<const Bits*>(values.const_data_ptr()), rows, width, flags.data_ptr<uint8_t>())
        case 2: ZEN_FLAGS(uint16_t); break;
        case 4: ZEN_FLAGS(uint32_t); break;
        case 8: ZEN_FLAGS(unsigned long long); break;
        default: TORCH_CHECK(false, "zen_ds nonzero_rows: unsupported dtype ", values.scalar_type());
#undef ZEN_FLAGS
    }
    ZEN_LAUNCH_CHECK();
    at::Tensor inclusive = at::cumsum(flags, 0, at::kLong);
    const int64_t total = inclusive[rows - 1].item<int64_t>();
    at::Tensor out = at::empty({total}, id_opts);
    if (total == 0) return out;
    ZEN_LAUNCH(grid_for(rows), kThreads, 0, stream, compact_kernel)(
        flags.data_ptr<uint8_t>(), inclusive.data_ptr<int64_t>(), rows, out.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> partition(const at::Tensor& rows,
                                                         const at::Tensor& values,
                                                         const PermArgs& perm,
                                                         int64_t world_size,
                                                         bool int32_ids)
{
    check_ids(rows, "partition rows");
    TORCH_CHECK(ZEN_ON_DEVICE(values) && values.is_contiguous() && values.dim() == 2 &&
                    values.size(0) == rows.numel(),
                "zen_ds partition: values must be a contiguous CUDA tensor [k, row_numel]");
    TORCH_CHECK(world_size >= 1 && world_size <= kMaxPartitionWorld,
                "zen_ds partition (CUDA): world_size must lie in [1, ", kMaxPartitionWorld, "]");
    TORCH_CHECK(static_cast<unsigned __int128>(perm.num_rows) * world_size <
                    (static_cast<unsigned __int128>(1) << 64),
                "zen_ds partition: num_rows * world_size must be < 2**64");
    if (int32_ids)
        TORCH_CHECK(perm.num_rows / world_size + 1 <= INT32_MAX,
                    "zen_ds partition: shard size exceeds int32; use id_dtype=torch.int64");
    ZEN_DEVICE_GUARD(rows);
    auto stream = ZEN_STREAM();
    const int64_t k = rows.numel();
    const int64_t n = world_size;
    auto long_opts = rows.options();
    at::Tensor out_off = at::empty({k}, long_opts.dtype(int32_ids ? at::kInt : at::kLong));
    at::Tensor out_val = at::empty_like(values);
    if (k == 0) return {at::zeros({n}, long_opts), out_off, out_val};

    const int64_t blocks = (k + kThreads - 1) / kThreads;
    TORCH_CHECK(blocks <= INT32_MAX, "zen_ds partition: too many rows for one launch");
    at::Tensor owner = at::empty({k}, long_opts.dtype(at::kInt));
    at::Tensor shard_off = at::empty({k}, long_opts);
    at::Tensor hist = at::empty({n * blocks}, long_opts);
    at::Tensor bad = error_flag(rows);
    const Permutation p = make_perm(perm, n);
    ZEN_LAUNCH(blocks, kThreads, n * sizeof(int32_t), stream, owner_hist_kernel)(
        reinterpret_cast<const uint64_t*>(rows.const_data_ptr<int64_t>()), k, p,
        owner.data_ptr<int32_t>(), shard_off.data_ptr<int64_t>(), hist.data_ptr<int64_t>(),
        bad.data_ptr<int32_t>());
    ZEN_LAUNCH_CHECK();
    at::Tensor counts = hist.view({n, blocks}).sum(1);
    at::Tensor base = at::cumsum(hist, 0) - hist;  // exclusive scan, owner-major then block
    at::Tensor dest = at::empty({k}, long_opts);
    const size_t shmem = kWarps * n * sizeof(int32_t);
    if (int32_ids)
        ZEN_LAUNCH(blocks, kThreads, shmem, stream, partition_scatter_kernel<int32_t>)(
            owner.data_ptr<int32_t>(), shard_off.data_ptr<int64_t>(), k, n, base.data_ptr<int64_t>(),
            dest.data_ptr<int64_t>(), out_off.data_ptr<int32_t>());
    else
        ZEN_LAUNCH(blocks, kThreads, shmem, stream, partition_scatter_kernel<int64_t>)(
            owner.data_ptr<int32_t>(), shard_off.data_ptr<int64_t>(), k, n, base.data_ptr<int64_t>(),
            dest.data_ptr<int64_t>(), out_off.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    copy_rows(values.const_data_ptr(), out_val.data_ptr(), dest.data_ptr<int64_t>(), k,
              values.size(1) * values.element_size(), stream);
    raise_if_flagged(bad, std::string("zen_ds partition: every row id must lie in [0, num_rows=") +
                              std::to_string(perm.num_rows) + ")");
    return {counts, out_off, out_val};
}

std::tuple<at::Tensor, at::Tensor> aggregate(const at::Tensor& offsets,
                                             const at::Tensor& values,
                                             at::ScalarType accum_dtype,
                                             int64_t terms)
{
    check_ids(offsets, "aggregate offsets");
    TORCH_CHECK(ZEN_ON_DEVICE(values) && values.is_contiguous() && values.dim() == 2 &&
                    values.size(0) == offsets.numel(),
                "zen_ds aggregate: values must be a contiguous CUDA tensor [k, row_numel]");
    TORCH_CHECK(accum_dtype == at::kFloat || accum_dtype == at::kDouble,
                "zen_ds aggregate: accum_dtype must be float32 or float64");
    ZEN_DEVICE_GUARD(offsets);
    auto stream = ZEN_STREAM();
    const int64_t k = offsets.numel();
    const int64_t width = values.size(1);
    auto long_opts = offsets.options();
    if (k == 0) return {at::empty({0}, long_opts), at::zeros({0, width}, values.options().dtype(accum_dtype))};

    auto sorted = at::sort(offsets, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    at::Tensor keys = std::get<0>(sorted);
    at::Tensor order = std::get<1>(sorted);
    TORCH_CHECK(keys[0].item<int64_t>() >= 0, "zen_ds aggregate: offsets must be >= 0");
    at::Tensor head = at::empty({k}, long_opts);
    ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, segment_heads_kernel)(keys.data_ptr<int64_t>(), k,
                                                               head.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    at::Tensor seg = at::cumsum(head, 0);
    const int64_t u = seg[k - 1].item<int64_t>();
    at::Tensor starts = at::empty({u + 1}, long_opts);
    at::Tensor unique = at::empty({u}, long_opts);
    ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, segment_starts_kernel)(
        keys.data_ptr<int64_t>(), head.data_ptr<int64_t>(), seg.data_ptr<int64_t>(), k,
        starts.data_ptr<int64_t>(), unique.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    at::Tensor sums = at::empty({u, width}, values.options().dtype(accum_dtype));
    if (u * width == 0) return {unique, sums};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_aggregate_cuda", [&] {
        if (accum_dtype == at::kFloat)
            ZEN_LAUNCH(grid_for(u * width), kThreads, 0, stream, segment_sum_kernel<scalar_t, float>)(
                values.const_data_ptr<scalar_t>(), order.data_ptr<int64_t>(),
                starts.data_ptr<int64_t>(), u, width, terms, sums.data_ptr<float>());
        else
            ZEN_LAUNCH(grid_for(u * width), kThreads, 0, stream, segment_sum_kernel<scalar_t, double>)(
                values.const_data_ptr<scalar_t>(), order.data_ptr<int64_t>(),
                starts.data_ptr<int64_t>(), u, width, terms, sums.data_ptr<double>());
    });
    ZEN_LAUNCH_CHECK();
    return {unique, sums};
}

at::Tensor bitmap_encode(const at::Tensor& offsets, int64_t universe)
{
    check_ids(offsets, "bitmap_encode offsets");
    TORCH_CHECK(universe >= 0, "zen_ds bitmap_encode: universe must be >= 0");
    ZEN_DEVICE_GUARD(offsets);
    auto stream = ZEN_STREAM();
    const int64_t nbytes = (universe + 7) / 8;
    const int64_t nwords = (nbytes + 3) / 4;
    at::Tensor words = at::zeros({nwords * 4}, offsets.options().dtype(at::kByte));
    const int64_t k = offsets.numel();
    if (k > 0) {
        at::Tensor bad = error_flag(offsets);
        ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, bitmap_set_kernel)(
            offsets.data_ptr<int64_t>(), k, universe,
            reinterpret_cast<unsigned int*>(words.data_ptr<uint8_t>()), bad.data_ptr<int32_t>());
        ZEN_LAUNCH_CHECK();
        raise_if_flagged(bad, std::string("zen_ds bitmap_encode: offsets must lie in [0, universe=") +
                                  std::to_string(universe) + ")");
    }
    return words.narrow(0, 0, nbytes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aggregate_bitmap(const at::Tensor& offsets,
                                                                const at::Tensor& values,
                                                                at::ScalarType accum_dtype,
                                                                int64_t universe, int64_t terms)
{
    TORCH_CHECK(universe >= 0, "zen_ds aggregate_bitmap: universe must be >= 0");
    // The segmented sum already sorts the offsets; the bitmap is one kernel over the (sorted,
    // unique) result, which also checks the range.
    auto result = aggregate(offsets, values, accum_dtype, terms);
    at::Tensor bitmap = bitmap_encode(std::get<0>(result), universe);
    return {std::get<0>(result), std::get<1>(result), bitmap};
}

at::Tensor bitmap_decode(const at::Tensor& bitmap, int64_t universe)
{
    TORCH_CHECK(ZEN_ON_DEVICE(bitmap) && bitmap.scalar_type() == at::kByte && bitmap.is_contiguous(),
                "zen_ds bitmap_decode: bitmap must be a contiguous uint8 CUDA tensor");
    TORCH_CHECK(universe >= 0, "zen_ds bitmap_decode: universe must be >= 0");
    ZEN_DEVICE_GUARD(bitmap);
    auto stream = ZEN_STREAM();
    const int64_t nbits = std::min<int64_t>(bitmap.numel() * 8, universe);
    const int64_t nbytes = (nbits + 7) / 8;
    auto long_opts = bitmap.options().dtype(at::kLong);
    if (nbytes == 0) return at::empty({0}, long_opts);
    const int64_t nwords = (nbytes + 3) / 4;
    at::Tensor counts = at::empty({nwords}, bitmap.options().dtype(at::kInt));
    const uint8_t* bytes = bitmap.const_data_ptr<uint8_t>();
    ZEN_LAUNCH(grid_for(nwords), kThreads, 0, stream, word_popcount_kernel)(
        bytes, nbytes, nbits, nwords, counts.data_ptr<int32_t>());
    ZEN_LAUNCH_CHECK();
    at::Tensor inclusive = at::cumsum(counts, 0, at::kLong);
    const int64_t total = inclusive[nwords - 1].item<int64_t>();
    at::Tensor out = at::empty({total}, long_opts);
    if (total == 0) return out;
    ZEN_LAUNCH(grid_for(nwords), kThreads, 0, stream, bitmap_positions_kernel)(
        bytes, nbytes, nbits, nwords, inclusive.data_ptr<int64_t>(), out.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    return out;
}

void scatter_rows(at::Tensor& out, const at::Tensor& rows, const at::Tensor& values)
{
    check_ids(rows, "scatter_rows rows");
    TORCH_CHECK(ZEN_ON_DEVICE(out) && out.is_contiguous() && out.dim() == 2 && values.is_contiguous() &&
                    values.dim() == 2 && values.scalar_type() == out.scalar_type() &&
                    values.size(1) == out.size(1) && values.size(0) == rows.numel(),
                "zen_ds scatter_rows: expected contiguous out [R, W] and values [k, W] of one dtype");
    ZEN_DEVICE_GUARD(out);
    auto stream = ZEN_STREAM();
    const int64_t k = rows.numel();
    if (k == 0) return;
    at::Tensor bad = error_flag(rows);
    ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, check_range_kernel)(rows.data_ptr<int64_t>(), k, out.size(0),
                                                             bad.data_ptr<int32_t>());
    ZEN_LAUNCH_CHECK();
    raise_if_flagged(bad, std::string("zen_ds scatter_rows: row ids must lie in [0, ") +
                              std::to_string(out.size(0)) + ")");
    copy_rows(values.const_data_ptr(), out.data_ptr(), rows.data_ptr<int64_t>(), k,
              out.size(1) * out.element_size(), stream);
}

void scatter_shard(at::Tensor& out, const at::Tensor& index, const at::Tensor& values, bool bitmap,
                   int64_t universe, int64_t shard_start, const PermArgs& perm)
{
    TORCH_CHECK(ZEN_ON_DEVICE(out) && out.is_contiguous() && out.dim() == 2 && ZEN_ON_DEVICE(values) &&
                    values.is_contiguous() && values.dim() == 2 &&
                    values.scalar_type() == out.scalar_type() && values.size(1) == out.size(1),
                "zen_ds scatter_shard: expected contiguous CUDA out [R, W] and values [k, W] of one dtype");
    TORCH_CHECK(ZEN_ON_DEVICE(index) && index.is_contiguous(),
                "zen_ds scatter_shard: index must be a contiguous CUDA tensor");
    TORCH_CHECK(out.size(0) == perm.num_rows, "zen_ds scatter_shard: out has ", out.size(0),
                " rows but num_rows is ", perm.num_rows);
    TORCH_CHECK(universe >= 0 && shard_start >= 0 && shard_start + universe <= perm.num_rows,
                "zen_ds scatter_shard: shard outside [0, num_rows)");
    ZEN_DEVICE_GUARD(out);
    auto stream = ZEN_STREAM();
    const Permutation p = make_perm(perm, 1);
    const int64_t k = values.size(0);
    const uint64_t start = static_cast<uint64_t>(shard_start);
    // Per-shard row ids in device scratch (k int64), then the shared row copy.
    at::Tensor rows = at::empty({k}, out.options().dtype(at::kLong));
    if (bitmap) {
        TORCH_CHECK(index.scalar_type() == at::kByte, "zen_ds scatter_shard: a bitmap must be uint8");
        const int64_t nbits = std::min<int64_t>(index.numel() * 8, universe);
        const int64_t nbytes = (nbits + 7) / 8;
        int64_t total = 0;
        at::Tensor inclusive;
        const uint8_t* bytes = index.const_data_ptr<uint8_t>();
        const int64_t nwords = (nbytes + 3) / 4;
        if (nbytes > 0) {
            at::Tensor counts = at::empty({nwords}, out.options().dtype(at::kInt));
            ZEN_LAUNCH(grid_for(nwords), kThreads, 0, stream, word_popcount_kernel)(
                bytes, nbytes, nbits, nwords, counts.data_ptr<int32_t>());
            ZEN_LAUNCH_CHECK();
            inclusive = at::cumsum(counts, 0, at::kLong);
            total = inclusive[nwords - 1].item<int64_t>();
        }
        TORCH_CHECK(total == k, "zen_ds scatter_shard: the bitmap has ", total,
                    " set bits but values has ", k, " rows");
        if (k == 0) return;
        ZEN_LAUNCH(grid_for(nwords), kThreads, 0, stream, shard_rows_bitmap_kernel)(
            bytes, nbytes, nbits, nwords, inclusive.data_ptr<int64_t>(), start, p,
            rows.data_ptr<int64_t>());
        ZEN_LAUNCH_CHECK();
    } else {
        TORCH_CHECK(index.numel() == k, "zen_ds scatter_shard: ", index.numel(),
                    " offsets but values has ", k, " rows");
        TORCH_CHECK(index.scalar_type() == at::kInt || index.scalar_type() == at::kLong,
                    "zen_ds scatter_shard: COO offsets must be int32 or int64");
        if (k == 0) return;
        at::Tensor bad = error_flag(out);
        if (index.scalar_type() == at::kInt)
            ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, shard_rows_coo_kernel<int32_t>)(
                index.const_data_ptr<int32_t>(), k, universe, start, p, rows.data_ptr<int64_t>(),
                bad.data_ptr<int32_t>());
        else
            ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, shard_rows_coo_kernel<int64_t>)(
                index.const_data_ptr<int64_t>(), k, universe, start, p, rows.data_ptr<int64_t>(),
                bad.data_ptr<int32_t>());
        ZEN_LAUNCH_CHECK();
        raise_if_flagged(bad, std::string("zen_ds scatter_shard: offsets must lie in [0, universe=") +
                                  std::to_string(universe) + ")");
    }
    copy_rows(values.const_data_ptr(), out.data_ptr(), rows.data_ptr<int64_t>(), k,
              out.size(1) * out.element_size(), stream);
}

}  // namespace cuda
}  // namespace zen
