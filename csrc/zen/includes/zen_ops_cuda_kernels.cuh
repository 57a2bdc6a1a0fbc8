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
// atomicAdd, atomicOr, __any_sync, __match_any_sync, __shfl_up_sync, __popc, __ffs, uint2, uint4).
//
// Every launch goes to the current stream; sizes and indices are 64-bit. Results are
// deterministic: integer atomics only count or claim, and every floating-point sum adds its rows
// in input order, so the kernels give the bits of the torch reference on the CPU.
//
// Shapes of the work:
// - Row moves (partition, scatter_rows, scatter_shard) copy each row with a group of lanes (a
//   power of two up to a warp, sized to the row) in the widest unit the pointers allow.
// - The owner partition is one histogram pass and one scatter pass (a stable counting sort with
//   warp-match ranks) that moves each row's id and values: lossless, no hash table, no "empty".
// - A bitmap is scanned in tiles of kTileWords 32-bit words: one pass counts each tile's set bits,
//   one block scans the tile counts, a second pass block-scans the words' popcounts inside each
//   tile and writes every set bit's position (or rank). No per-byte or per-word count array in
//   global memory, and, when the caller knows the number of set bits, no read of it on the host.
// - aggregate is a counted scatter: each row's destination is the rank of its offset (a bitmap
//   rank when the offsets' range is compact, else a sort), integer atomics count the rows per
//   destination, a destination with one row gets a plain store, the others sum their rows in
//   input order (per-destination row lists sorted by input index), accumulating in fp32/fp64.
#pragma once

#include "zen_ops.h"
#include "zen_permute.h"

#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/_assert_async.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#ifndef ZEN_LAUNCH
#error "include zen_ops_cuda_kernels.cuh from zen_ops_cuda.cu or the emulation, which define the platform"
#endif

// Mutation points. The GPU build compiles the correct constants; the emulation makes each a
// run-time switch (emu_set_fault) to show that the tests catch such a bug:
// - "warp_prefix_skips_warp0": the first warp counted in the partition's per-warp prefix is 1.
// - "scan_off_by_one": the block scan's first shuffle step leaves out lane 0 (lanes >= 2 add).
#ifndef ZEN_MUTATION_WARP_PREFIX_FIRST
#define ZEN_MUTATION_WARP_PREFIX_FIRST 0
#endif
#ifndef ZEN_MUTATION_SCAN_FIRST_LANE
#define ZEN_MUTATION_SCAN_FIRST_LANE 0
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
constexpr int kScanWords = 4;  // bitmap words per thread in a tile (one 16-byte load)
constexpr int64_t kTileWords = int64_t(kThreads) * kScanWords;
// Tile counts up to this many are scanned by one block (one launch); more by a device-wide scan.
constexpr int64_t kMaxOneBlockScan = 4 * kThreads;
// A destination with at most this many rows has its row list sorted by one thread (insertion
// sort); with more, aggregate sorts all destinations with one stable radix sort instead.
constexpr int64_t kMaxListSort = 64;

int64_t grid_for(int64_t work)
{
    return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, kMaxGrid));
}

// log2 of the lanes that move one row of `units`: the smallest power of two covering the row,
// at most a warp, so narrow rows do not leave most of a warp idle.
int lane_shift_for(int64_t units)
{
    int shift = 0;
    while (shift < 5 && (int64_t(1) << shift) < units) ++shift;
    return shift;
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

// Checks `ok` (a one-element bool tensor) without waiting for the device: on a GPU a failure is
// a device-side assertion (the process stops at its next synchronisation, as torch's own index
// checks do); on the emulation's CPU tensors it raises here.
void assert_on_device(const at::Tensor& ok, const std::string& message)
{
    at::_assert_async(ok, message);
}

__device__ __forceinline__ int64_t global_thread() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return int64_t(gridDim.x) * blockDim.x; }

// Exclusive prefix sum of x over the block's threads in thread order; *total gets the block's
// sum. Every thread of a kThreads block calls it; `shared` holds kWarps values.
__device__ __forceinline__ int64_t block_exclusive_sum(int64_t x, int64_t* shared, int64_t* total)
{
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    int64_t inclusive = x;
    for (int delta = 1; delta < 32; delta <<= 1) {
        const int64_t below = __shfl_up_sync(0xffffffffu, inclusive, delta);
        if (lane >= delta + ZEN_MUTATION_SCAN_FIRST_LANE) inclusive += below;
    }
    if (lane == 31) shared[warp] = inclusive;
    __syncthreads();
    int64_t before = 0, sum = 0;
    for (int w = 0; w < kWarps; ++w) {
        const int64_t s = shared[w];
        before += w < warp ? s : 0;
        sum += s;
    }
    __syncthreads();  // the next call overwrites `shared`
    *total = sum;
    return before + inclusive - x;
}

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

// ---------------------------------------------------------------- row moves

// dst[index[i]] = src[i] for k rows of `units` Units: 2**shift lanes per row. An index outside
// [0, dst_rows) is skipped: the callers have raised (or asserted on the device) by then.
template <typename Unit>
__global__ void copy_rows_kernel(const Unit* __restrict__ src, Unit* __restrict__ dst,
                                 const int64_t* __restrict__ index, int64_t k, int64_t units,
                                 int64_t dst_rows, int shift)
{
    const int64_t lanes = int64_t(1) << shift;
    const int64_t lane = threadIdx.x & (lanes - 1);
    for (int64_t i = global_thread() >> shift; i < k; i += grid_stride() >> shift) {
        const uint64_t row = static_cast<uint64_t>(index[i]);
        if (row >= static_cast<uint64_t>(dst_rows)) continue;
        const Unit* from = src + i * units;
        Unit* to = dst + static_cast<int64_t>(row) * units;
        for (int64_t u = lane; u < units; u += lanes) to[u] = from[u];
    }
}

// The widest copy unit that the pointers and the row size allow, as a byte count.
int copy_unit_bytes(const void* src, const void* dst, int64_t row_bytes)
{
    const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                            static_cast<uintptr_t>(row_bytes);
    return align % 16 == 0 ? 16 : align % 8 == 0 ? 8 : align % 4 == 0 ? 4 : align % 2 == 0 ? 2 : 1;
}

// Copy k rows of row_bytes to dst[index[i]] (dst has dst_rows rows).
void copy_rows(const void* src, void* dst, const int64_t* index, int64_t k, int64_t row_bytes,
               int64_t dst_rows, ZenStream stream)
{
    if (k == 0 || row_bytes == 0) return;
    const int unit = copy_unit_bytes(src, dst, row_bytes);
    const int64_t units = row_bytes / unit;
    const int shift = lane_shift_for(units);
    const int64_t grid = grid_for(k << shift);
#define ZEN_COPY(Unit)                                                                   \
    ZEN_LAUNCH(grid, kThreads, 0, stream, copy_rows_kernel<Unit>)(                       \
        static_cast<const Unit*>(src), static_cast<Unit*>(dst), index, k, units, dst_rows, shift)
    switch (unit) {
        case 16: ZEN_COPY(uint4); break;
        case 8: ZEN_COPY(uint2); break;
        case 4: ZEN_COPY(uint32_t); break;
        case 2: ZEN_COPY(uint16_t); break;
        default: ZEN_COPY(uint8_t); break;
    }
#undef ZEN_COPY
    ZEN_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- partition

// (owner, shard offset) of a row id; an id outside [0, num_rows) raises *bad and counts as row 0.
__device__ __forceinline__ uint64_t owner_and_offset(uint64_t x, const Permutation& p,
                                                     uint64_t* shard_offset, int32_t* bad)
{
    if (x >= p.rows.d) {
        if (bad) *bad = 1;
        x = 0;
    }
    return owner_of(permute_one(x, p), p, shard_offset);
}

// Pass 1: per-block histogram of the owners, written owner-major.
__global__ void owner_hist_kernel(const uint64_t* __restrict__ ids, int64_t k, Permutation p,
                                  int64_t* __restrict__ hist, int32_t* bad)
{
    ZEN_SHARED_ARRAY(int32_t, block_hist);  // [world_size]
    const int64_t n = static_cast<int64_t>(p.world_size);
    for (int64_t o = threadIdx.x; o < n; o += blockDim.x) block_hist[o] = 0;
    __syncthreads();
    const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
    if (i < k) {
        uint64_t unused;
        atomicAdd(&block_hist[owner_and_offset(ids[i], p, &unused, bad)], 1);
    }
    __syncthreads();
    for (int64_t o = threadIdx.x; o < n; o += blockDim.x)
        hist[o * gridDim.x + blockIdx.x] = block_hist[o];
}

// Pass 2: stable destination of each row = scanned base of (owner, block) + rank inside the block
// among rows with the same owner (warp match + per-warp counts); writes the row's shard offset,
// then the block moves its rows' values (a group of lanes per row) to their destinations.
template <typename Id, typename Unit>
__global__ void partition_scatter_kernel(const uint64_t* __restrict__ ids, int64_t k, Permutation p,
                                         const int64_t* __restrict__ base, Id* __restrict__ out_off,
                                         const Unit* __restrict__ src, Unit* __restrict__ dst,
                                         int64_t units, int shift)
{
    ZEN_SHARED_ARRAY(int64_t, block_dest);  // [kThreads] destinations, then [kWarps][n] counts
    const int64_t n = static_cast<int64_t>(p.world_size);
    int32_t* warp_hist = reinterpret_cast<int32_t*>(block_dest + kThreads);
    for (int64_t j = threadIdx.x; j < kWarps * n; j += blockDim.x) warp_hist[j] = 0;
    __syncthreads();
    const int64_t first = blockIdx.x * int64_t(kThreads);
    const int64_t i = first + threadIdx.x;
    const bool valid = i < k;
    uint64_t shard_offset = 0;
    const int32_t o = valid ? static_cast<int32_t>(owner_and_offset(ids[i], p, &shard_offset, nullptr))
                            : static_cast<int32_t>(n);  // sentinel groups the tail
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const unsigned peers = __match_any_sync(0xffffffffu, o);
    const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
    if (valid && rank_in_warp == 0) warp_hist[warp * n + o] = __popc(peers);
    __syncthreads();
    if (valid) {
        int64_t rank = rank_in_warp;
        for (int w = ZEN_MUTATION_WARP_PREFIX_FIRST; w < warp; ++w) rank += warp_hist[w * n + o];
        const int64_t d = base[o * int64_t(gridDim.x) + blockIdx.x] + rank;
        out_off[d] = static_cast<Id>(shard_offset);
        block_dest[threadIdx.x] = d;
    }
    __syncthreads();
    const int64_t rows = k - first < kThreads ? k - first : kThreads;
    const int64_t lanes = int64_t(1) << shift;
    const int64_t row_lane = threadIdx.x & (lanes - 1);
    for (int64_t r = threadIdx.x >> shift; r < rows; r += kThreads >> shift) {
        const Unit* from = src + (first + r) * units;
        Unit* to = dst + block_dest[r] * units;
        for (int64_t u = row_lane; u < units; u += lanes) to[u] = from[u];
    }
}

// ---------------------------------------------------------------- bitmap scans

// A bitmap as the scans read it: `nbits` positions in `nbytes` bytes at any byte address.
struct BitmapView {
    const uint8_t* bytes;
    int64_t nbytes;
    int64_t nbits;
    int64_t nwords;  // 32-bit words
    int64_t ntiles;
    int align;  // 16, 4 or 1: whole-word (or 4-word) loads where the address allows
};

BitmapView bitmap_view(const uint8_t* bytes, int64_t available_bytes, int64_t universe)
{
    BitmapView b;
    b.bytes = bytes;
    b.nbits = std::min<int64_t>(available_bytes * 8, universe);
    b.nbytes = (b.nbits + 7) / 8;
    b.nwords = (b.nbytes + 3) / 4;
    b.ntiles = (b.nwords + kTileWords - 1) / kTileWords;
    const uintptr_t address = reinterpret_cast<uintptr_t>(bytes);
    b.align = address % 16 == 0 ? 16 : address % 4 == 0 ? 4 : 1;
    return b;
}

// Word w assembled from bytes (byte j holds bits 8j..8j+7: position w * 32 + bit, the same as
// (4w + j) * 8 + bit in byte order).
__device__ __forceinline__ unsigned int word_from_bytes(const uint8_t* bytes, int64_t w, int64_t nbytes)
{
    unsigned int v = 0;
    for (int j = 0; j < 4; ++j) {
        const int64_t b = w * 4 + j;
        if (b < nbytes) v |= static_cast<unsigned int>(bytes[b]) << (8 * j);
    }
    return v;
}

// The kScanWords words from word `first` on (a multiple of kScanWords), bits at or past nbits
// cleared, words past the end 0.
__device__ __forceinline__ void load_scan_words(const BitmapView& b, int64_t first,
                                                unsigned int (&v)[kScanWords])
{
    if (b.align == 16 && (first + kScanWords) * 4 <= b.nbytes) {
        const uint4 q = reinterpret_cast<const uint4*>(b.bytes)[first / kScanWords];
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
    } else {
        for (int j = 0; j < kScanWords; ++j) {
            const int64_t w = first + j;
            v[j] = w >= b.nwords ? 0u
                   : b.align >= 4 && (w + 1) * 4 <= b.nbytes
                       ? reinterpret_cast<const unsigned int*>(b.bytes)[w]
                       : word_from_bytes(b.bytes, w, b.nbytes);
        }
    }
    for (int j = 0; j < kScanWords; ++j) {
        const int64_t valid = b.nbits - (first + j) * 32;
        if (valid <= 0) v[j] = 0;
        else if (valid < 32) v[j] &= (1u << valid) - 1u;
    }
}

static_assert(kScanWords == 4, "load_scan_words reads one uint4 per thread");

// Pass 1: the set bits of each tile.
__global__ void tile_popcount_kernel(BitmapView b, int64_t* __restrict__ tile_counts)
{
    ZEN_SHARED_ARRAY(int64_t, shared);  // [kWarps]
    for (int64_t tile = blockIdx.x; tile < b.ntiles; tile += gridDim.x) {
        unsigned int v[kScanWords];
        load_scan_words(b, tile * kTileWords + int64_t(threadIdx.x) * kScanWords, v);
        int64_t c = 0;
        for (int j = 0; j < kScanWords; ++j) c += __popc(v[j]);
        int64_t total;
        block_exclusive_sum(c, shared, &total);
        if (threadIdx.x == 0) tile_counts[tile] = total;
    }
}

// One block: out[i] = counts[0] + ... + counts[i - 1] for i < n, and out[n] = the total.
__global__ void exclusive_scan_kernel(const int64_t* __restrict__ counts, int64_t n,
                                      int64_t* __restrict__ out)
{
    ZEN_SHARED_ARRAY(int64_t, shared);  // [kWarps]
    int64_t carry = 0;
    for (int64_t first = 0; first < n; first += kThreads) {
        const int64_t i = first + threadIdx.x;
        const int64_t x = i < n ? counts[i] : 0;
        int64_t total;
        const int64_t before = block_exclusive_sum(x, shared, &total);
        if (i < n) out[i] = carry + before;
        carry += total;
    }
    if (threadIdx.x == 0) out[n] = carry;
}

// What pass 2 writes for set bit p of rank d: out[d] = p, or with `to_rows` the row
// pi^-1(shard_start + p) of a pulled shard; only ranks below `limit` (the output's size).
struct ScanOutput {
    int64_t* out;  // nullptr: no positions
    int64_t limit;
    bool to_rows;
    uint64_t shard_start;
    Permutation perm;
    int32_t* word_rank;  // nullptr, or per word: its first bit's rank inside its tile
};

// Pass 2: block scan of the words' popcounts inside each tile, plus the tile's base.
__global__ void bitmap_scan_kernel(BitmapView b, const int64_t* __restrict__ tile_base, ScanOutput o)
{
    ZEN_SHARED_ARRAY(int64_t, shared);  // [kWarps]
    for (int64_t tile = blockIdx.x; tile < b.ntiles; tile += gridDim.x) {
        const int64_t first = tile * kTileWords + int64_t(threadIdx.x) * kScanWords;
        unsigned int v[kScanWords];
        load_scan_words(b, first, v);
        int64_t c = 0;
        for (int j = 0; j < kScanWords; ++j) c += __popc(v[j]);
        int64_t total;
        const int64_t in_tile = block_exclusive_sum(c, shared, &total);
        if (o.word_rank) {
            int64_t r = in_tile;
            for (int j = 0; j < kScanWords && first + j < b.nwords; ++j) {
                o.word_rank[first + j] = static_cast<int32_t>(r);
                r += __popc(v[j]);
            }
        }
        if (o.out == nullptr) continue;
        int64_t d = tile_base[tile] + in_tile;
        for (int j = 0; j < kScanWords; ++j) {
            unsigned int word = v[j];
            while (word) {
                const uint64_t pos = static_cast<uint64_t>((first + j) * 32 + (__ffs(word) - 1));
                if (d < o.limit)
                    o.out[d] = static_cast<int64_t>(o.to_rows ? unpermute_one(o.shard_start + pos, o.perm)
                                                              : pos);
                ++d;
                word &= word - 1u;
            }
        }
    }
}

// Pass 1 and the scan of the tile counts: tile_base[t] = set bits before tile t, tile_base[ntiles]
// = all set bits (on the device).
at::Tensor scan_tiles(const BitmapView& b, const at::Tensor& like, ZenStream stream)
{
    auto long_opts = like.options().dtype(at::kLong);
    if (b.ntiles == 0) return at::zeros({1}, long_opts);
    at::Tensor counts = at::empty({b.ntiles}, long_opts);
    at::Tensor base = at::empty({b.ntiles + 1}, long_opts);
    const size_t shmem = kWarps * sizeof(int64_t);
    ZEN_LAUNCH(std::min(b.ntiles, kMaxGrid), kThreads, shmem, stream, tile_popcount_kernel)(
        b, counts.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    if (b.ntiles <= kMaxOneBlockScan) {
        ZEN_LAUNCH(1, kThreads, shmem, stream, exclusive_scan_kernel)(counts.data_ptr<int64_t>(), b.ntiles,
                                                                     base.data_ptr<int64_t>());
        ZEN_LAUNCH_CHECK();
    } else {  // one block would loop over the tiles: the device-wide scan
        base.narrow(0, 0, 1).zero_();
        at::Tensor inclusive = base.narrow(0, 1, b.ntiles);
        at::cumsum_out(inclusive, counts, 0);
    }
    return base;
}

void scan_bitmap(const BitmapView& b, const at::Tensor& tile_base, const ScanOutput& o, ZenStream stream)
{
    if (b.ntiles == 0) return;
    ZEN_LAUNCH(std::min(b.ntiles, kMaxGrid), kThreads, kWarps * sizeof(int64_t), stream,
               bitmap_scan_kernel)(b, tile_base.data_ptr<int64_t>(), o);
    ZEN_LAUNCH_CHECK();
}

ScanOutput positions_output(int64_t* out, int64_t limit)
{
    return ScanOutput{out, limit, false, 0, make_permutation(1, 0, 0, 0, 1), nullptr};
}

// The set-bit count on the device equals the caller's `count` (checked without a host read).
void assert_count(const at::Tensor& tile_base, int64_t count, const char* op, const char* what)
{
    assert_on_device(tile_base.select(0, tile_base.numel() - 1).eq(count),
                     std::string("zen_ds ") + op + ": the bitmap's set bits differ from " + what +
                         " (" + std::to_string(count) + "): a truncated or corrupted payload");
}

// ---------------------------------------------------------------- aggregate

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

// Each row's destination (the rank of its offset among the set bits) and its arrival number at
// that destination (atomic claim: counts[d] ends as the destination's number of rows). Offsets
// outside [0, universe) were flagged by bitmap_set_kernel and are skipped.
__global__ void rank_rows_kernel(const int64_t* __restrict__ off, int64_t k, int64_t universe,
                                 const unsigned int* __restrict__ words,
                                 const int64_t* __restrict__ tile_base,
                                 const int32_t* __restrict__ word_rank, int64_t* __restrict__ dest,
                                 int64_t* __restrict__ arrival, unsigned long long* __restrict__ counts)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride()) {
        const int64_t p = off[i];
        if (p < 0 || p >= universe) {
            dest[i] = arrival[i] = 0;
            continue;
        }
        const int64_t w = p >> 5;
        const unsigned int below = words[w] & ((1u << (p & 31)) - 1u);
        int64_t d = tile_base[w / kTileWords] + word_rank[w] + __popc(below);
        d = d < k ? d : k;  // only a broken scan ranks past k: keep counts[] in bounds anyway
        dest[i] = d;
        arrival[i] = static_cast<int64_t>(atomicAdd(counts + d, 1ull));
    }
}

// Sort path: a segment starts where the sorted key changes.
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

// list[starts[dest[i]] + arrival[i]] = i: each destination's rows, in arrival order. Writes stay
// inside the destination's range even where counts and arrivals disagree (broken atomics).
__global__ void list_rows_kernel(const int64_t* __restrict__ dest, const int64_t* __restrict__ arrival,
                                 int64_t k, const int64_t* __restrict__ starts, int64_t u,
                                 int64_t* __restrict__ list)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride()) {
        const int64_t d = dest[i];
        if (d >= u) continue;
        const int64_t at = starts[d] + arrival[i];
        if (at < starts[d + 1]) list[at] = i;
    }
}

// Each destination's rows back into input order (insertion sort; at most kMaxListSort rows).
__global__ void sort_lists_kernel(const int64_t* __restrict__ starts, int64_t u, int64_t* __restrict__ list)
{
    for (int64_t d = global_thread(); d < u; d += grid_stride()) {
        const int64_t s = starts[d], e = starts[d + 1];
        for (int64_t a = s + 1; a < e; ++a) {
            const int64_t x = list[a];
            int64_t b = a;
            for (; b > s && list[b - 1] > x; --b) list[b] = list[b - 1];
            list[b] = x;
        }
    }
}

// Value -> accumulator like torch's values.to(accum_dtype): reduced floats widen exactly.
template <typename Acc, typename T>
__device__ __forceinline__ Acc to_acc(T v)
{
    if constexpr (std::is_same<T, double>::value) return static_cast<Acc>(v);
    else return static_cast<Acc>(static_cast<float>(v));
}

// A sum starts from -0.0, the additive identity (a sum of -0.0 stays -0.0); a row that fewer
// than `terms` contributors sent also sums the others' +0.0, so it starts from +0.0.
template <typename Acc>
__device__ __forceinline__ Acc first_term(int64_t rows, int64_t terms)
{
    return rows < terms ? Acc(0) : -Acc(0);
}

// Every destination holds one row: sums[dest[i]] = first term + values[i] (plain stores).
template <typename T, typename Acc>
__global__ void store_rows_kernel(const T* __restrict__ values, const int64_t* __restrict__ dest,
                                  int64_t k, int64_t u, int64_t width, int64_t terms,
                                  Acc* __restrict__ sums, int shift)
{
    const int64_t lanes = int64_t(1) << shift;
    const int64_t lane = threadIdx.x & (lanes - 1);
    const Acc first = first_term<Acc>(1, terms);
    for (int64_t i = global_thread() >> shift; i < k; i += grid_stride() >> shift) {
        if (dest[i] >= u) continue;  // only with broken atomics or scans
        const T* row = values + i * width;
        Acc* out = sums + dest[i] * width;
        for (int64_t j = lane; j < width; j += lanes) {
            Acc acc = first;
            acc += to_acc<Acc>(row[j]);
            out[j] = acc;
        }
    }
}

// sums[d] = first term + the rows list[starts[d] .. starts[d + 1]) in list order (input order).
template <typename T, typename Acc>
__global__ void sum_lists_kernel(const T* __restrict__ values, const int64_t* __restrict__ list,
                                 const int64_t* __restrict__ starts, int64_t u, int64_t width,
                                 int64_t terms, Acc* __restrict__ sums, int shift)
{
    const int64_t lanes = int64_t(1) << shift;
    const int64_t lane = threadIdx.x & (lanes - 1);
    for (int64_t d = global_thread() >> shift; d < u; d += grid_stride() >> shift) {
        const int64_t s = starts[d], e = starts[d + 1];
        const Acc first = first_term<Acc>(e - s, terms);
        Acc* out = sums + d * width;
        for (int64_t j = lane; j < width; j += lanes) {
            Acc acc = first;
            for (int64_t m = s; m < e; ++m) acc += to_acc<Acc>(values[list[m] * width + j]);
            out[j] = acc;
        }
    }
}

// ---------------------------------------------------------------- scatter checks and rows

__global__ void check_range_kernel(const int64_t* __restrict__ ids, int64_t k, int64_t limit, int32_t* bad)
{
    for (int64_t i = global_thread(); i < k; i += grid_stride())
        if (ids[i] < 0 || ids[i] >= limit) *bad = 1;
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

// Launches the sums: with `list`, sums[d] adds the rows list[starts[d] .. starts[d + 1]) in list
// order; without, every destination has one row and sums[dest[i]] gets row i.
template <typename T, typename Acc>
void launch_sums(const at::Tensor& values, const int64_t* dest, const int64_t* list,
                 const int64_t* starts, int64_t u, int64_t terms, at::Tensor& sums, ZenStream stream)
{
    const int64_t k = values.size(0);
    const int64_t width = values.size(1);
    const int shift = lane_shift_for(width);
    if (list == nullptr)
        ZEN_LAUNCH(grid_for(k << shift), kThreads, 0, stream, store_rows_kernel<T, Acc>)(
            values.const_data_ptr<T>(), dest, k, u, width, terms, sums.data_ptr<Acc>(), shift);
    else
        ZEN_LAUNCH(grid_for(u << shift), kThreads, 0, stream, sum_lists_kernel<T, Acc>)(
            values.const_data_ptr<T>(), list, starts, u, width, terms, sums.data_ptr<Acc>(), shift);
    ZEN_LAUNCH_CHECK();
}

// The [u, width] sums in accum_dtype (see launch_sums).
at::Tensor sum_rows(const at::Tensor& values, const int64_t* dest, const int64_t* list,
                    const int64_t* starts, int64_t u, int64_t terms, at::ScalarType accum_dtype,
                    ZenStream stream)
{
    at::Tensor sums = at::empty({u, values.size(1)}, values.options().dtype(accum_dtype));
    if (sums.numel() == 0) return sums;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_aggregate_cuda", [&] {
        if (accum_dtype == at::kFloat)
            launch_sums<scalar_t, float>(values, dest, list, starts, u, terms, sums, stream);
        else
            launch_sums<scalar_t, double>(values, dest, list, starts, u, terms, sums, stream);
    });
    return sums;
}

// Sums of the rows sharing a destination, given every row's destination (`dest`, < u) and
// arrival number there, and each destination's row count (`counts`, >= u entries). `most`: the
// largest count. Every sum adds its rows in input order.
at::Tensor sum_by_destination(const at::Tensor& values, const at::Tensor& dest, const at::Tensor& arrival,
                              const at::Tensor& counts, int64_t u, int64_t most,
                              at::ScalarType accum_dtype, int64_t terms, ZenStream stream)
{
    const int64_t k = values.size(0);
    if (most <= 1 || u * values.size(1) == 0)  // one row each: plain stores
        return sum_rows(values, dest.data_ptr<int64_t>(), nullptr, nullptr, u, terms, accum_dtype, stream);
    // starts: exclusive scan of the counts; list: each destination's rows in input order.
    at::Tensor starts = at::empty({u + 1}, dest.options());
    starts.narrow(0, 0, 1).zero_();
    at::Tensor inclusive = starts.narrow(0, 1, u);
    at::cumsum_out(inclusive, counts.narrow(0, 0, u), 0);
    at::Tensor list;
    if (most <= kMaxListSort) {
        list = at::zeros({k}, dest.options());  // every entry is written unless atomics broke
        ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, list_rows_kernel)(
            dest.data_ptr<int64_t>(), arrival.data_ptr<int64_t>(), k, starts.data_ptr<int64_t>(), u,
            list.data_ptr<int64_t>());
        ZEN_LAUNCH_CHECK();
        ZEN_LAUNCH(grid_for(u), kThreads, 0, stream, sort_lists_kernel)(
            starts.data_ptr<int64_t>(), u, list.data_ptr<int64_t>());
        ZEN_LAUNCH_CHECK();
    } else {
        list = std::get<1>(at::sort(dest, /*stable=*/true, /*dim=*/0, /*descending=*/false));
    }
    return sum_rows(values, nullptr, list.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), u, terms,
                    accum_dtype, stream);
}

// The counted aggregation over a bitmap of `universe` positions (`words`: zeroed, whole 32-bit
// words): sets the offsets' bits, ranks them, counts the rows per destination, reads (u, the
// largest count, the range flag) in one host read, then sums. Returns (unique, sums).
std::tuple<at::Tensor, at::Tensor> aggregate_by_bitmap(const at::Tensor& offsets, const at::Tensor& values,
                                                       at::ScalarType accum_dtype, int64_t terms,
                                                       int64_t universe, at::Tensor& words,
                                                       const char* op, ZenStream stream)
{
    const int64_t k = offsets.numel();
    auto long_opts = offsets.options();
    at::Tensor bad = error_flag(offsets);
    unsigned int* word_ptr = reinterpret_cast<unsigned int*>(words.data_ptr<uint8_t>());
    ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, bitmap_set_kernel)(
        offsets.data_ptr<int64_t>(), k, universe, word_ptr, bad.data_ptr<int32_t>());
    ZEN_LAUNCH_CHECK();
    const BitmapView b = bitmap_view(words.data_ptr<uint8_t>(), words.numel(), universe);
    at::Tensor tile_base = scan_tiles(b, offsets, stream);
    at::Tensor unique = at::empty({k}, long_opts);  // u <= k: narrowed below
    at::Tensor word_rank = at::empty({std::max<int64_t>(b.nwords, 1)}, long_opts.dtype(at::kInt));
    ScanOutput o = positions_output(unique.data_ptr<int64_t>(), k);
    o.word_rank = word_rank.data_ptr<int32_t>();
    scan_bitmap(b, tile_base, o, stream);
    at::Tensor dest = at::empty({k}, long_opts);
    at::Tensor arrival = at::empty({k}, long_opts);
    at::Tensor counts = at::zeros({k + 1}, long_opts);  // + 1: room for any rank a wrong bitmap gives
    ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, rank_rows_kernel)(
        offsets.data_ptr<int64_t>(), k, universe, word_ptr, tile_base.data_ptr<int64_t>(),
        word_rank.data_ptr<int32_t>(), dest.data_ptr<int64_t>(), arrival.data_ptr<int64_t>(),
        reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()));
    ZEN_LAUNCH_CHECK();
    const at::Tensor facts = at::stack({tile_base.select(0, b.ntiles), at::amax(counts),
                                        bad.select(0, 0).to(at::kLong)})
                                 .cpu();
    const int64_t* fact = facts.const_data_ptr<int64_t>();
    TORCH_CHECK(fact[2] == 0, "zen_ds ", op, ": offsets must lie in [0, universe=", universe, ")");
    const int64_t u = fact[0];
    at::Tensor sums = sum_by_destination(values, dest, arrival, counts, u, fact[1], accum_dtype, terms, stream);
    return {unique.narrow(0, 0, u), sums};
}

// The aggregation by a stable sort of the offsets (offsets spread far wider than their number).
std::tuple<at::Tensor, at::Tensor> aggregate_by_sort(const at::Tensor& offsets, const at::Tensor& values,
                                                     at::ScalarType accum_dtype, int64_t terms,
                                                     ZenStream stream)
{
    const int64_t k = offsets.numel();
    auto long_opts = offsets.options();
    auto sorted = at::sort(offsets, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    at::Tensor keys = std::get<0>(sorted);
    at::Tensor list = std::get<1>(sorted);
    at::Tensor head = at::empty({k}, long_opts);
    ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, segment_heads_kernel)(keys.data_ptr<int64_t>(), k,
                                                                       head.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    at::Tensor seg = at::cumsum(head, 0);
    at::Tensor starts = at::empty({k + 1}, long_opts);  // u + 1 <= k + 1: narrowed below
    at::Tensor unique = at::empty({k}, long_opts);
    ZEN_LAUNCH(grid_for(k), kThreads, 0, stream, segment_starts_kernel)(
        keys.data_ptr<int64_t>(), head.data_ptr<int64_t>(), seg.data_ptr<int64_t>(), k,
        starts.data_ptr<int64_t>(), unique.data_ptr<int64_t>());
    ZEN_LAUNCH_CHECK();
    const int64_t u = seg[k - 1].item<int64_t>();
    at::Tensor sums = sum_rows(values, nullptr, list.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), u,
                               terms, accum_dtype, stream);
    return {unique.narrow(0, 0, u), sums};
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
    at::Tensor hist = at::empty({n * blocks}, long_opts);
    at::Tensor bad = error_flag(rows);
    const Permutation p = make_perm(perm, n);
    const uint64_t* ids = reinterpret_cast<const uint64_t*>(rows.const_data_ptr<int64_t>());
    ZEN_LAUNCH(blocks, kThreads, n * sizeof(int32_t), stream, owner_hist_kernel)(
        ids, k, p, hist.data_ptr<int64_t>(), bad.data_ptr<int32_t>());
    ZEN_LAUNCH_CHECK();
    at::Tensor counts = hist.view({n, blocks}).sum(1);
    at::Tensor base = at::cumsum(hist, 0) - hist;  // exclusive scan, owner-major then block
    const size_t shmem = kThreads * sizeof(int64_t) + kWarps * n * sizeof(int32_t);
    const int64_t row_bytes = values.size(1) * values.element_size();
    const void* src = values.const_data_ptr();
    void* dst = out_val.data_ptr();
    const int unit = row_bytes == 0 ? 1 : copy_unit_bytes(src, dst, row_bytes);
    const int64_t units = row_bytes / unit;
    const int shift = lane_shift_for(units);
#define ZEN_SCATTER(Id, Unit)                                                                       \
    ZEN_LAUNCH(blocks, kThreads, shmem, stream, partition_scatter_kernel<Id, Unit>)(                \
        ids, k, p, base.data_ptr<int64_t>(), out_off.data_ptr<Id>(), static_cast<const Unit*>(src), \
        static_cast<Unit*>(dst), units, shift)
#define ZEN_SCATTER_UNITS(Id)                        \
    switch (unit) {                                  \
        case 16: ZEN_SCATTER(Id, uint4); break;      \
        case 8: ZEN_SCATTER(Id, uint2); break;       \
        case 4: ZEN_SCATTER(Id, uint32_t); break;    \
        case 2: ZEN_SCATTER(Id, uint16_t); break;    \
        default: ZEN_SCATTER(Id, uint8_t); break;    \
    }
    if (int32_ids) {
        ZEN_SCATTER_UNITS(int32_t)
    } else {
        ZEN_SCATTER_UNITS(int64_t)
    }
#undef ZEN_SCATTER_UNITS
#undef ZEN_SCATTER
    ZEN_LAUNCH_CHECK();
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

    // The offsets' range decides the ranking: a bitmap over [0, max] when it is not much sparser
    // than the rows (the same bound as the CPU kernels), else a sort.
    const auto range = at::aminmax(offsets);
    const at::Tensor bounds = at::stack({std::get<0>(range), std::get<1>(range)}).cpu();
    const int64_t lo = bounds.const_data_ptr<int64_t>()[0];
    const int64_t hi = bounds.const_data_ptr<int64_t>()[1];
    TORCH_CHECK(lo >= 0, "zen_ds aggregate: offsets must be >= 0, got ", lo);
    if (hi / 64 + 1 > 4 * k + 4096) return aggregate_by_sort(offsets, values, accum_dtype, terms, stream);
    const int64_t universe = hi + 1;
    at::Tensor words = at::zeros({(universe + 31) / 32 * 4}, long_opts.dtype(at::kByte));
    return aggregate_by_bitmap(offsets, values, accum_dtype, terms, universe, words, "aggregate", stream);
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
    check_ids(offsets, "aggregate_bitmap offsets");
    TORCH_CHECK(ZEN_ON_DEVICE(values) && values.is_contiguous() && values.dim() == 2 &&
                    values.size(0) == offsets.numel(),
                "zen_ds aggregate_bitmap: values must be a contiguous CUDA tensor [k, row_numel]");
    TORCH_CHECK(accum_dtype == at::kFloat || accum_dtype == at::kDouble,
                "zen_ds aggregate_bitmap: accum_dtype must be float32 or float64");
    TORCH_CHECK(universe >= 0, "zen_ds aggregate_bitmap: universe must be >= 0");
    ZEN_DEVICE_GUARD(offsets);
    auto stream = ZEN_STREAM();
    const int64_t nbytes = (universe + 7) / 8;
    // The bitmap the aggregation ranks by is the result's bitmap.
    at::Tensor words = at::zeros({(nbytes + 3) / 4 * 4}, offsets.options().dtype(at::kByte));
    const int64_t k = offsets.numel();
    if (k == 0)
        return {at::empty({0}, offsets.options()),
                at::zeros({0, values.size(1)}, values.options().dtype(accum_dtype)), words.narrow(0, 0, nbytes)};
    auto result = aggregate_by_bitmap(offsets, values, accum_dtype, terms, universe, words,
                                      "aggregate_bitmap", stream);
    return {std::get<0>(result), std::get<1>(result), words.narrow(0, 0, nbytes)};
}

at::Tensor bitmap_decode(const at::Tensor& bitmap, int64_t universe, int64_t count)
{
    TORCH_CHECK(ZEN_ON_DEVICE(bitmap) && bitmap.scalar_type() == at::kByte && bitmap.is_contiguous(),
                "zen_ds bitmap_decode: bitmap must be a contiguous uint8 CUDA tensor");
    TORCH_CHECK(universe >= 0, "zen_ds bitmap_decode: universe must be >= 0");
    ZEN_DEVICE_GUARD(bitmap);
    auto stream = ZEN_STREAM();
    const BitmapView b = bitmap_view(bitmap.const_data_ptr<uint8_t>(), bitmap.numel(), universe);
    auto long_opts = bitmap.options().dtype(at::kLong);
    if (b.nwords == 0) {
        TORCH_CHECK(count <= 0, "zen_ds bitmap_decode: an empty bitmap has no set bits, not ", count);
        return at::empty({0}, long_opts);
    }
    at::Tensor tile_base = scan_tiles(b, bitmap, stream);
    // With the caller's count the output is sized without waiting for the device.
    const int64_t total = count >= 0 ? count : tile_base[b.ntiles].item<int64_t>();
    at::Tensor out = at::empty({total}, long_opts);
    if (total > 0) scan_bitmap(b, tile_base, positions_output(out.data_ptr<int64_t>(), total), stream);
    if (count >= 0) assert_count(tile_base, count, "bitmap_decode", "count");
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
              out.size(1) * out.element_size(), out.size(0), stream);
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
    // Per-shard row ids in device scratch (k int64), then the shared row copy. Nothing is read
    // on the host: values' row count is the number of set bits / offsets, checked on the device.
    at::Tensor rows = at::empty({k}, out.options().dtype(at::kLong));
    if (bitmap) {
        TORCH_CHECK(index.scalar_type() == at::kByte, "zen_ds scatter_shard: a bitmap must be uint8");
        const BitmapView b = bitmap_view(index.const_data_ptr<uint8_t>(), index.numel(), universe);
        if (b.nwords == 0) {
            TORCH_CHECK(k == 0, "zen_ds scatter_shard: the bitmap has 0 set bits but values has ", k,
                        " rows");
            return;
        }
        at::Tensor tile_base = scan_tiles(b, out, stream);
        if (k > 0) {
            ScanOutput o = positions_output(rows.data_ptr<int64_t>(), k);
            o.to_rows = true;
            o.shard_start = start;
            o.perm = p;
            scan_bitmap(b, tile_base, o, stream);
        }
        assert_count(tile_base, k, "scatter_shard", "the rows of values");
        if (k == 0) return;
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
        assert_on_device(bad.select(0, 0).eq(0),
                         std::string("zen_ds scatter_shard: offsets must lie in [0, universe=") +
                             std::to_string(universe) + ")");
    }
    copy_rows(values.const_data_ptr(), out.data_ptr(), rows.data_ptr<int64_t>(), k,
              out.size(1) * out.element_size(), out.size(0), stream);
}

}  // namespace cuda
}  // namespace zen
