// zen_ds CPU kernels. Each op touches its data once where it can, splits work into one contiguous
// chunk per thread (at::parallel_for over chunk ids, so it follows torch's thread pool), and keeps
// per-thread state in small arrays instead of atomics. Sizes and indices are 64-bit throughout.
#include "zen_ops.h"
#include "zen_partition_simd.h"
#include "zen_permute.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

namespace zen {
namespace cpu {
namespace {

// Number of chunks for `work` items: one per thread, none smaller than `grain` items.
int64_t num_chunks(int64_t work, int64_t grain)
{
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    return std::max<int64_t>(1, std::min<int64_t>(threads, work / std::max<int64_t>(grain, 1)));
}

inline int64_t chunk_begin(int64_t chunk, int64_t chunks, int64_t work)
{
    return static_cast<int64_t>((static_cast<unsigned __int128>(chunk) * work) / chunks);
}

// Run fn(chunk, begin, end) for every chunk, one chunk per task.
template <typename Fn>
void for_each_chunk(int64_t chunks, int64_t work, const Fn& fn)
{
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t c = lo; c < hi; ++c)
            fn(c, chunk_begin(c, chunks, work), chunk_begin(c + 1, chunks, work));
    });
}

Permutation make_perm(const PermArgs& a, int64_t world_size)
{
    return make_permutation(static_cast<uint64_t>(a.num_rows), static_cast<uint64_t>(a.multiplier),
                            static_cast<uint64_t>(a.inverse), static_cast<uint64_t>(a.offset),
                            static_cast<uint64_t>(world_size));
}

void check_ids(const at::Tensor& t, const char* what)
{
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), what,
                " must be a contiguous int64 CPU tensor");
}

// Copy one row of `bytes` bytes; fixed small widths become single loads/stores (1-D tensors).
inline void copy_row(char* dst, const char* src, int64_t bytes)
{
    switch (bytes) {
        case 2: std::memcpy(dst, src, 2); break;
        case 4: std::memcpy(dst, src, 4); break;
        case 8: std::memcpy(dst, src, 8); break;
        case 16: std::memcpy(dst, src, 16); break;
        default: std::memcpy(dst, src, static_cast<size_t>(bytes));
    }
}

// Row copy with the width fixed at compile time where it is small (1-D tensors: 2, 4, 8 bytes).
template <int64_t kBytes>
struct RowCopy {
    static inline void run(char* __restrict dst, const char* __restrict src, int64_t)
    {
        std::memcpy(dst, src, kBytes);
    }
};
template <>
struct RowCopy<0> {
    static inline void run(char* __restrict dst, const char* __restrict src, int64_t bytes)
    {
        std::memcpy(dst, src, static_cast<size_t>(bytes));
    }
};

template <typename Fn>
void with_row_copy(int64_t row_bytes, const Fn& fn)
{
    switch (row_bytes) {
        case 2: fn(RowCopy<2>{}); break;
        case 4: fn(RowCopy<4>{}); break;
        case 8: fn(RowCopy<8>{}); break;
        case 16: fn(RowCopy<16>{}); break;
        default: fn(RowCopy<0>{});
    }
}

// Element-wise test on the raw bits: every element that is not +0.0 counts (NaN, denormals and
// -0.0, so that a row that is -0.0 on every rank is synced and sums to -0.0), immune to
// fast-math flags.
template <typename Bits>
int64_t nonzero_rows_chunk(const Bits* data, int64_t width, int64_t begin, int64_t end,
                           std::vector<int64_t>& found)
{
    constexpr Bits mask = static_cast<Bits>(~Bits(0));
    constexpr int64_t kBlock = 64;
    if (width == 1) {
        int64_t i = begin;
        for (; i + kBlock <= end; i += kBlock) {
            Bits any = 0;
#pragma omp simd reduction(| : any)
            for (int64_t j = 0; j < kBlock; ++j) any |= data[i + j] & mask;
            if (any == 0) continue;
            for (int64_t j = 0; j < kBlock; ++j)
                if (data[i + j] & mask) found.push_back(i + j);
        }
        for (; i < end; ++i)
            if (data[i] & mask) found.push_back(i);
        return static_cast<int64_t>(found.size());
    }
    for (int64_t r = begin; r < end; ++r) {
        const Bits* row = data + r * width;
        bool nonzero = false;
        for (int64_t j0 = 0; j0 < width && !nonzero; j0 += kBlock) {
            const int64_t j1 = std::min(width, j0 + kBlock);
            Bits any = 0;
#pragma omp simd reduction(| : any)
            for (int64_t j = j0; j < j1; ++j) any |= row[j] & mask;
            nonzero = any != 0;
        }
        if (nonzero) found.push_back(r);
    }
    return static_cast<int64_t>(found.size());
}

template <typename Bits>
at::Tensor nonzero_rows_impl(const at::Tensor& values)
{
    const int64_t rows = values.size(0);
    const int64_t width = values.dim() == 1 ? 1 : values.size(1);
    const Bits* data = reinterpret_cast<const Bits*>(values.const_data_ptr());
    const int64_t chunks = num_chunks(rows * std::max<int64_t>(width, 1), 1 << 16);
    // Per-chunk result buffers are kept across calls (clear() keeps capacity): no per-call
    // allocation proportional to the number of non-zero rows.
    // (thread_local names resolve per executing thread, so the workers get a plain reference.)
    thread_local std::vector<std::vector<int64_t>> found_cache;
    std::vector<std::vector<int64_t>>& found = found_cache;
    if (static_cast<int64_t>(found.size()) < chunks) found.resize(chunks);
    for (int64_t c = 0; c < chunks; ++c) found[c].clear();
    if (width > 0) {
        for_each_chunk(chunks, rows, [&](int64_t c, int64_t b, int64_t e) {
            nonzero_rows_chunk<Bits>(data, width, b, e, found[c]);
        });
    }
    std::vector<int64_t> starts(chunks + 1, 0);
    for (int64_t c = 0; c < chunks; ++c) starts[c + 1] = starts[c] + found[c].size();
    at::Tensor out = at::empty({starts[chunks]}, values.options().dtype(at::kLong));
    int64_t* dst = out.data_ptr<int64_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t c = lo; c < hi; ++c)
            if (!found[c].empty())
                std::memcpy(dst + starts[c], found[c].data(), found[c].size() * sizeof(int64_t));
    });
    return out;
}

// Sum rows `src` into `dst` (row width `width`) in accumulation type Acc.
template <typename T, typename Acc>
inline void add_row(Acc* __restrict dst, const T* __restrict src, int64_t width)
{
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) dst[j] += static_cast<Acc>(src[j]);
}

// Store the 64 bits of bitset word `w` (bit b = offset 64 * w + b) as bitmap bytes 8w..8w+7 in
// bitmap_encode's layout (byte i holds offsets 8i..8i+7, lowest offset in the lowest bit), cut at
// `nbytes`. On a little-endian machine that layout is the word's memory image.
inline void store_bitmap_word(uint8_t* __restrict bm, int64_t nbytes, int64_t w, uint64_t bits)
{
    const int64_t at = w * 8;
    const int64_t n = std::min<int64_t>(8, nbytes - at);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (n == 8) {
        std::memcpy(bm + at, &bits, 8);
        return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) bm[at + j] = static_cast<uint8_t>(bits >> (8 * j));
}

// Stable LSD radix sort of the input indices by key (keys in [0, max_key]): `order` gets the
// indices in ascending key order, ties in input order, and `sorted_keys` their keys. Digits of at
// most 11 bits keep the histogram in L1. A comparison sort of indirect keys is several times
// slower on sparse supports (94k unique rows of a 25.6M universe: 9 ms against ~1 ms).
void radix_sort_indices(const int64_t* keys, int64_t k, int64_t max_key,
                        std::vector<int64_t>& order, std::vector<int64_t>& sorted_keys)
{
    const int bits = max_key > 0 ? 64 - __builtin_clzll(static_cast<uint64_t>(max_key)) : 1;
    const int passes = (bits + 10) / 11;
    const int digit = (bits + passes - 1) / passes;
    const uint64_t mask = (uint64_t(1) << digit) - 1;
    std::vector<int64_t> key_a(keys, keys + k), key_b(k), idx_a(k), idx_b(k);
    std::iota(idx_a.begin(), idx_a.end(), 0);
    std::vector<int64_t> cursor(size_t(1) << digit);
    for (int pass = 0; pass < passes; ++pass) {
        const int shift = pass * digit;
        std::fill(cursor.begin(), cursor.end(), 0);
        const uint64_t* __restrict ka = reinterpret_cast<const uint64_t*>(key_a.data());
        for (int64_t i = 0; i < k; ++i) ++cursor[(ka[i] >> shift) & mask];
        int64_t running = 0;
        for (int64_t& c : cursor) {
            const int64_t h = c;
            c = running;
            running += h;
        }
        const int64_t* __restrict ia = idx_a.data();
        int64_t* __restrict kb = key_b.data();
        int64_t* __restrict ib = idx_b.data();
        for (int64_t i = 0; i < k; ++i) {
            const int64_t d = cursor[(ka[i] >> shift) & mask]++;
            kb[d] = static_cast<int64_t>(ka[i]);
            ib[d] = ia[i];
        }
        key_a.swap(key_b);
        idx_a.swap(idx_b);
    }
    order.swap(idx_a);
    sorted_keys.swap(key_a);
}

// Start one output row: the sum of `count` rows out of `terms` contributors. -0.0 is the additive
// identity, so a sum of -0.0 rows stays -0.0 as IEEE addition gives; a row fewer than `terms`
// contributors sent also sums the others' +0.0, so it starts from +0.0 (-0.0 + +0.0 = +0.0).
template <typename Acc>
inline void start_row(Acc* __restrict row, int64_t width, int64_t count, int64_t terms)
{
    const Acc first = count < terms ? Acc(0) : -Acc(0);
    for (int64_t j = 0; j < width; ++j) row[j] = first;
}

// Sum rows sharing an offset (unique offsets ascending, sums in Acc), each row as the sum of its
// inputs and of the +0.0 of the `terms` - count contributors that sent none (start_row). When
// `fused` (the fused aggregate_bitmap), also writes every one of the `bm_bytes` bytes at `bm`: the
// bitmap_encode of the unique offsets over `universe` positions (bm_bytes = ceil(universe / 8)),
// from the bitset the aggregation builds anyway. Offsets outside [0, universe) are refused here.
template <typename T, typename Acc>
std::tuple<at::Tensor, at::Tensor> aggregate_impl(const at::Tensor& offsets, const at::Tensor& values,
                                                  at::ScalarType accum_dtype, int64_t terms,
                                                  bool fused = false,
                                                  uint8_t* bm = nullptr, int64_t bm_bytes = 0,
                                                  int64_t universe = 0)
{
    const int64_t k = offsets.numel();
    const int64_t width = values.size(1);
    const int64_t* off = offsets.const_data_ptr<int64_t>();
    const T* val = values.const_data_ptr<T>();
    auto id_opts = offsets.options().dtype(at::kLong);
    auto acc_opts = values.options().dtype(accum_dtype);
    if (k == 0) {
        if (bm && bm_bytes) std::memset(bm, 0, bm_bytes);
        return {at::empty({0}, id_opts), at::zeros({0, width}, acc_opts)};
    }

    // Bounds of the offsets (they are shard-relative, so usually small).
    const int64_t chunks = num_chunks(k, 1 << 14);
    std::vector<int64_t> lo(chunks, INT64_MAX), hi(chunks, INT64_MIN);
    for_each_chunk(chunks, k, [&](int64_t c, int64_t b, int64_t e) {
        int64_t mn = INT64_MAX, mx = INT64_MIN;
        for (int64_t i = b; i < e; ++i) {
            mn = std::min(mn, off[i]);
            mx = std::max(mx, off[i]);
        }
        lo[c] = mn;
        hi[c] = mx;
    });
    const int64_t min_off = *std::min_element(lo.begin(), lo.end());
    const int64_t max_off = *std::max_element(hi.begin(), hi.end());
    TORCH_CHECK(min_off >= 0, "zen_ds aggregate: offsets must be >= 0, got ", min_off);
    if (fused) {
        TORCH_CHECK(max_off < universe, "zen_ds aggregate_bitmap: offsets must lie in [0, universe=",
                    universe, "), got ", max_off);
    }

    at::Tensor unique;
    std::vector<int64_t> order;  // sort path: input indices grouped by offset, stable
    std::vector<int64_t> group;  // sort path: start of each output slot in `order`
    const int64_t nwords = max_off / 64 + 1;
    // Sort-free path when the offsets' range is not much sparser than k: a bitset over [0, max]
    // plus a per-word rank table gives every offset its output slot. The O(max/64) scratch is
    // reused across calls (no per-call allocation, no page faults).
    const bool bitset = nwords <= 4 * k + 4096;
    // thread_local names resolve per executing thread: workers only see the raw pointers below.
    // One 16-byte entry per word holds its bits and the rank of its first bit, so finding an
    // offset's output slot touches one cache line.
    struct WordRank {
        uint64_t bits;
        int64_t rank;
    };
    thread_local std::vector<WordRank> table_cache;
    thread_local std::vector<int64_t> slot_cache;
    std::vector<WordRank>& table_vec = table_cache;
    std::vector<int64_t>& slot_vec = slot_cache;
    int64_t u = 0;
    constexpr int kBucketShift = 12;  // 4096 words (64 KB of table, 256 Ki offsets) per bucket
    if (bitset && nwords > (int64_t(1) << kBucketShift)) {
        // Large universe (1-D top-k shards): the table and the sums do not fit in L2, so random
        // slot lookups would miss on every input. A stable radix pass first groups the inputs by
        // bucket of 4096 words; each bucket is then aggregated with its table slice and its
        // output range in cache, buckets in parallel. Inputs keep their order inside a bucket, so
        // every sum adds its inputs in input order (deterministic, thread-count independent).
        const int64_t nb = ((nwords - 1) >> kBucketShift) + 1;
        table_vec.assign(nwords, WordRank{0, 0});
        WordRank* const table = table_vec.data();
        thread_local std::vector<uint32_t> local_cache;  // offset within its bucket (< 2**18)
        thread_local std::vector<int64_t> index_cache;   // input row (wide rows)
        thread_local std::vector<Acc> value_cache;       // input value (width 1)
        if (static_cast<int64_t>(local_cache.size()) < k) local_cache.resize(k);
        uint32_t* const loc = local_cache.data();
        int64_t* idx = nullptr;
        Acc* vbuf = nullptr;
        if (width == 1) {
            if (static_cast<int64_t>(value_cache.size()) < k) value_cache.resize(k);
            vbuf = value_cache.data();
        } else {
            if (static_cast<int64_t>(index_cache.size()) < k) index_cache.resize(k);
            idx = index_cache.data();
        }
        const int64_t chunks = num_chunks(k, 1 << 14);
        std::vector<int64_t> hist(chunks * nb, 0);
        int64_t* const h_all = hist.data();
        constexpr int kOffShift = kBucketShift + 6;
        for_each_chunk(chunks, k, [=](int64_t c, int64_t b, int64_t e) {
            int64_t* __restrict h = h_all + c * nb;
            for (int64_t i = b; i < e; ++i) ++h[off[i] >> kOffShift];
        });
        std::vector<int64_t> bucket_start(nb + 1, 0);
        int64_t running = 0;
        for (int64_t bk = 0; bk < nb; ++bk) {
            bucket_start[bk] = running;
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t h = hist[c * nb + bk];
                hist[c * nb + bk] = running;
                running += h;
            }
        }
        bucket_start[nb] = running;
        for_each_chunk(chunks, k, [=](int64_t c, int64_t b, int64_t e) {
            int64_t* __restrict cur = h_all + c * nb;
            uint32_t* __restrict lo_ = loc;
            for (int64_t i = b; i < e; ++i) {
                const int64_t d = cur[off[i] >> kOffShift]++;
                lo_[d] = static_cast<uint32_t>(off[i] & ((int64_t(1) << kOffShift) - 1));
                if (vbuf)
                    vbuf[d] = static_cast<Acc>(val[i]);
                else
                    idx[d] = i;
            }
        });
        // Phase A: each bucket sets its bits and ranks its words locally.
        std::vector<int64_t> bucket_u(nb + 1, 0);
        const int64_t* const bs = bucket_start.data();
        int64_t* const bu = bucket_u.data();
        at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
            for (int64_t bk = b0; bk < b1; ++bk) {
                WordRank* t = table + (bk << kBucketShift);
                const int64_t words = std::min<int64_t>(int64_t(1) << kBucketShift,
                                                        nwords - (bk << kBucketShift));
                const int64_t d0 = bs[bk], d1 = bs[bk + 1];
                const uint32_t* __restrict lb = loc;
                for (int64_t d = d0; d < d1; ++d) t[lb[d] >> 6].bits |= 1ull << (lb[d] & 63);
                int64_t r = 0;
                if (bm) {
                    // Fused bitmap: this bucket's words, stored while they are in cache.
                    const int64_t w0 = bk << kBucketShift;
                    for (int64_t w = 0; w < words; ++w) {
                        t[w].rank = r;
                        r += __builtin_popcountll(t[w].bits);
                        store_bitmap_word(bm, bm_bytes, w0 + w, t[w].bits);
                    }
                } else {
                    for (int64_t w = 0; w < words; ++w) {
                        t[w].rank = r;
                        r += __builtin_popcountll(t[w].bits);
                    }
                }
                bu[bk + 1] = r;
            }
        });
        for (int64_t bk = 0; bk < nb; ++bk) bucket_u[bk + 1] += bucket_u[bk];
        u = bucket_u[nb];
        if (bm && nwords * 8 < bm_bytes) std::memset(bm + nwords * 8, 0, bm_bytes - nwords * 8);
        unique = at::empty({u}, id_opts);
        at::Tensor sums_b = at::empty({u, width}, acc_opts);  // rows started per bucket
        int64_t* const uq = unique.data_ptr<int64_t>();
        Acc* const outp = sums_b.data_ptr<Acc>();
        // Phase B: unique offsets and sums of each bucket into its own output range.
        at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
            for (int64_t bk = b0; bk < b1; ++bk) {
                const WordRank* t = table + (bk << kBucketShift);
                const int64_t base = bu[bk];
                const int64_t first_off = bk << kOffShift;
                const int64_t d0 = bs[bk], d1 = bs[bk + 1];
                const uint32_t* __restrict lb = loc;
                Acc* __restrict ob = outp + base * width;
                int64_t* __restrict ub = uq + base;
                auto slot_of = [t](uint32_t l) -> int64_t {
                    const WordRank wr = t[l >> 6];
                    return wr.rank + __builtin_popcountll(wr.bits & ((1ull << (l & 63)) - 1));
                };
                const int64_t rows_b = bu[bk + 1] - base;
                std::vector<int64_t> count(terms > 1 ? rows_b : 0, 0);
                if (terms > 1)
                    for (int64_t d = d0; d < d1; ++d) ++count[slot_of(lb[d])];
                for (int64_t s = 0; s < rows_b; ++s)
                    start_row<Acc>(ob + s * width, width, terms > 1 ? count[s] : terms, terms);
                // Every unique offset has at least one input, so writing the offset at the
                // input's slot fills `unique` without a data-dependent loop over set bits
                // (duplicates write the same value again).
                if (vbuf) {
                    const Acc* __restrict vb = vbuf;
                    for (int64_t d = d0; d < d1; ++d) {
                        const int64_t s = slot_of(lb[d]);
                        ub[s] = first_off + lb[d];
                        ob[s] += vb[d];
                    }
                } else {
                    for (int64_t d = d0; d < d1; ++d) {
                        const int64_t s = slot_of(lb[d]);
                        ub[s] = first_off + lb[d];
                        add_row<T, Acc>(ob + s * width, val + idx[d] * width, width);
                    }
                }
            }
        });
        return {unique, sums_b};
    }
    if (bitset) {
        table_vec.assign(nwords, WordRank{0, 0});
        if (static_cast<int64_t>(slot_vec.size()) < k) slot_vec.resize(k);
        WordRank* const table = table_vec.data();
        int64_t* const slot = slot_vec.data();
        // Each chunk owns a range of words and scans every offset: no atomics, no races.
        const int64_t set_chunks = num_chunks(k, 1 << 16);
        for_each_chunk(set_chunks, nwords, [=](int64_t, int64_t wb, int64_t we) {
            for (int64_t i = 0; i < k; ++i) {
                const int64_t w = off[i] >> 6;
                if (w >= wb && w < we) table[w].bits |= 1ull << (off[i] & 63);
            }
        });
        for (int64_t w = 0; w < nwords; ++w) {
            table[w].rank = u;
            u += __builtin_popcountll(table[w].bits);
        }
        if (bm) {
            for (int64_t w = 0; w < nwords; ++w) store_bitmap_word(bm, bm_bytes, w, table[w].bits);
            if (nwords * 8 < bm_bytes) std::memset(bm + nwords * 8, 0, bm_bytes - nwords * 8);
        }
        unique = at::empty({u}, id_opts);
        int64_t* uq = unique.data_ptr<int64_t>();
        for_each_chunk(num_chunks(nwords, 1 << 14), nwords, [=](int64_t, int64_t wb, int64_t we) {
            for (int64_t w = wb; w < we; ++w) {
                int64_t d = table[w].rank;
                for (uint64_t v = table[w].bits; v; v &= v - 1) uq[d++] = w * 64 + __builtin_ctzll(v);
            }
        });
        // Output slot of every input, in parallel over the inputs.
        for_each_chunk(num_chunks(k, 1 << 14), k, [=](int64_t, int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                const WordRank wr = table[off[i] >> 6];
                slot[i] = wr.rank + __builtin_popcountll(wr.bits & ((1ull << (off[i] & 63)) - 1));
            }
        });
    } else {
        std::vector<int64_t> sorted;
        radix_sort_indices(off, k, max_off, order, sorted);
        for (int64_t j = 0; j < k; ++j)
            if (j == 0 || sorted[j] != sorted[j - 1]) group.push_back(j);
        u = static_cast<int64_t>(group.size());
        group.push_back(k);
        unique = at::empty({u}, id_opts);
        int64_t* uq = unique.data_ptr<int64_t>();
        for (int64_t s = 0; s < u; ++s) uq[s] = sorted[group[s]];
        if (bm) {
            std::memset(bm, 0, bm_bytes);
            for (int64_t s = 0; s < u; ++s) bm[uq[s] >> 3] |= uint8_t(1u << (uq[s] & 7));
        }
    }

    const int64_t* const slots = slot_vec.data();
    at::Tensor sums = at::empty({u, width}, acc_opts);  // each chunk starts its rows (start_row)
    Acc* out = sums.data_ptr<Acc>();
    // Each thread owns a contiguous range of output slots and adds its inputs in input order, so
    // the result is deterministic and independent of the thread count. Every chunk scans the
    // precomputed slot of every input (a sequential read) and adds those in its range.
    const int64_t out_chunks = num_chunks(k * std::max<int64_t>(width, 4), 1 << 16);
    for_each_chunk(out_chunks, u, [&](int64_t, int64_t sb, int64_t se) {
        if (bitset) {
            std::vector<int64_t> count(terms > 1 ? se - sb : 0, 0);
            if (terms > 1)
                for (int64_t i = 0; i < k; ++i)
                    if (slots[i] >= sb && slots[i] < se) ++count[slots[i] - sb];
            for (int64_t s = sb; s < se; ++s)
                start_row<Acc>(out + s * width, width, terms > 1 ? count[s - sb] : terms, terms);
            if (width == 1) {
                for (int64_t i = 0; i < k; ++i) {
                    const int64_t s = slots[i];
                    if (s >= sb && s < se) out[s] += static_cast<Acc>(val[i]);
                }
            } else {
                for (int64_t i = 0; i < k; ++i) {
                    const int64_t s = slots[i];
                    if (s >= sb && s < se) add_row<T, Acc>(out + s * width, val + i * width, width);
                }
            }
        } else {
            for (int64_t s = sb; s < se; ++s) {
                start_row<Acc>(out + s * width, width, group[s + 1] - group[s], terms);
                for (int64_t j = group[s]; j < group[s + 1]; ++j)
                    add_row<T, Acc>(out + s * width, val + order[j] * width, width);
            }
        }
    });
    return {unique, sums};
}

}  // namespace

at::Tensor permute(const at::Tensor& rows, const PermArgs& perm, bool inverse)
{
    check_ids(rows, "permute input");
    const Permutation p = make_perm(perm, 1);
    const int64_t n = rows.numel();
    at::Tensor out = at::empty_like(rows);
    const uint64_t* src = reinterpret_cast<const uint64_t*>(rows.const_data_ptr<int64_t>());
    uint64_t* dst = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
    std::atomic<bool> bad{false};
    at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
        bool local_bad = false;
        for (int64_t i = b; i < e; ++i) {
            const uint64_t x = src[i];  // negative ids wrap to >= num_rows and are caught
            local_bad |= x >= p.rows.d;
            dst[i] = inverse ? unpermute_one(x < p.rows.d ? x : 0, p)
                             : permute_one(x < p.rows.d ? x : 0, p);
        }
        if (local_bad) bad.store(true, std::memory_order_relaxed);
    });
    TORCH_CHECK(!bad.load(), "zen_ds ", inverse ? "unpermute" : "permute",
                ": every id must lie in [0, num_rows=", perm.num_rows, ")");
    return out;
}

at::Tensor nonzero_rows(const at::Tensor& values)
{
    TORCH_CHECK(values.device().is_cpu() && values.is_contiguous() && values.dim() <= 2 &&
                    values.dim() >= 1,
                "zen_ds nonzero_rows: expected a contiguous 1-D or 2-D CPU tensor");
    switch (values.element_size()) {
        case 2: return nonzero_rows_impl<uint16_t>(values);
        case 4: return nonzero_rows_impl<uint32_t>(values);
        case 8: return nonzero_rows_impl<uint64_t>(values);
        default: TORCH_CHECK(false, "zen_ds nonzero_rows: unsupported dtype ", values.scalar_type());
    }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> partition(const at::Tensor& rows,
                                                         const at::Tensor& values,
                                                         const PermArgs& perm,
                                                         int64_t world_size,
                                                         bool int32_ids)
{
    check_ids(rows, "partition rows");
    TORCH_CHECK(values.device().is_cpu() && values.is_contiguous() && values.dim() == 2 &&
                    values.size(0) == rows.numel(),
                "zen_ds partition: values must be a contiguous CPU tensor [k, row_numel]");
    TORCH_CHECK(world_size >= 1, "zen_ds partition: world_size must be >= 1");
    TORCH_CHECK(static_cast<unsigned __int128>(perm.num_rows) * world_size < (((unsigned __int128)1) << 64),
                "zen_ds partition: num_rows * world_size must be < 2**64");
    const Permutation p = make_perm(perm, world_size);
    const int64_t k = rows.numel();
    const int64_t n = world_size;
    const int64_t row_bytes = values.size(1) * values.element_size();
    const uint64_t* ids = reinterpret_cast<const uint64_t*>(rows.const_data_ptr<int64_t>());
    const char* src = static_cast<const char*>(values.const_data_ptr());

    at::Tensor counts = at::zeros({n}, rows.options());
    at::Tensor out_off = at::empty({k}, rows.options().dtype(int32_ids ? at::kInt : at::kLong));
    at::Tensor out_val = at::empty_like(values);
    if (k == 0) return {counts, out_off, out_val};
    if (int32_ids)
        TORCH_CHECK(perm.num_rows / n + 1 <= INT32_MAX,
                    "zen_ds partition: shard size exceeds int32; use id_dtype=torch.int64");

    // Shard starts floor(r * N / n), exact in 128-bit, and a floating estimate of the owner that
    // the starts table then corrects: no integer division per row.
    std::vector<uint64_t> starts(n + 1);
    for (int64_t r = 0; r <= n; ++r)
        starts[r] = static_cast<uint64_t>((static_cast<unsigned __int128>(r) * p.rows.d) / n);
    const double owner_scale = static_cast<double>(n) / static_cast<double>(p.rows.d);
    const uint64_t* st = starts.data();
    auto owner_from = [st, owner_scale, n](uint64_t q) -> uint64_t {
        uint64_t o = static_cast<uint64_t>(static_cast<double>(q) * owner_scale);
        if (o >= static_cast<uint64_t>(n)) o = n - 1;
        while (q < st[o]) --o;
        while (q >= st[o + 1]) ++o;
        return o;
    };

    // Pass 1: shard offset and owner of every row into reusable scratch (O(k), kept across calls
    // so repeated steps do not page-fault), plus per-chunk owner histograms. Every pointer the
    // loops use is a local: stores through char* would otherwise force reloads of captured state.
    const int64_t chunks = num_chunks(k, 1 << 14);
    thread_local std::vector<uint64_t> pos_cache;
    thread_local std::vector<uint32_t> owner_cache;
    if (static_cast<int64_t>(pos_cache.size()) < k) {
        pos_cache.resize(k);
        owner_cache.resize(k);
    }
    uint64_t* const pos = pos_cache.data();  // thread_local names resolve per thread: raw pointers
    uint32_t* const own = owner_cache.data();
    std::vector<int64_t> hist(chunks * n, 0);
    int64_t* const hist_all = hist.data();
    std::vector<char> bad_chunk(chunks, 0);
    char* const bad_all = bad_chunk.data();
#ifdef ZEN_PARTITION_SIMD
    // AVX-512 pass 1 where its exactness preconditions hold; with few owners and 4- or 8-byte rows
    // also the vector scatter, whose scratch is compact (uint32 offsets, uint8 owners) in the same
    // buffers.
    const simd::PartitionParams sp{p.rows.d, p.multiplier, p.offset, static_cast<uint64_t>(n), st};
    const bool simd_map = simd::avx512_usable() && simd::params_fit(sp);
    const bool simd_scatter = simd_map && static_cast<uint64_t>(n) <= simd::kMaxScatterOwners &&
                              (row_bytes == 4 || row_bytes == 8);
    uint32_t* const pos32 = reinterpret_cast<uint32_t*>(pos);
    uint8_t* const own8 = reinterpret_cast<uint8_t*>(own);
#endif
    for_each_chunk(chunks, k, [=](int64_t c, int64_t b, int64_t e) {
        int64_t* __restrict h = hist_all + c * n;
#ifdef ZEN_PARTITION_SIMD
        if (simd_scatter) {
            bad_all[c] = !simd::map_rows_avx512(ids, b, e, sp, h, pos32, own8);
            return;
        }
        if (simd_map) {
            bad_all[c] = !simd::map_rows_avx512(ids, b, e, sp, h, pos, own);
            return;
        }
#endif
        uint64_t* __restrict pq = pos;
        uint32_t* __restrict po = own;
        const uint64_t* __restrict in = ids;
        const Permutation pl = p;
        const uint64_t N = pl.rows.d;
        bool local_bad = false;
        for (int64_t i = b; i < e; ++i) {
            const uint64_t x = in[i];
            local_bad |= x >= N;
            const uint64_t q = permute_one(x < N ? x : 0, pl);
            const uint64_t o = owner_from(q);
            pq[i] = q - st[o];
            po[i] = static_cast<uint32_t>(o);
            ++h[o];
        }
        bad_all[c] = local_bad;
    });
    TORCH_CHECK(std::none_of(bad_chunk.begin(), bad_chunk.end(), [](char x) { return x; }),
                "zen_ds partition: every row id must lie in [0, num_rows=", perm.num_rows, ")");

    // Exclusive scan in (owner, chunk) order -> write cursor of every chunk for every owner.
    int64_t* cnt = counts.data_ptr<int64_t>();
    int64_t running = 0;
    for (int64_t o = 0; o < n; ++o) {
        const int64_t before = running;
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t h = hist[c * n + o];
            hist[c * n + o] = running;
            running += h;
        }
        cnt[o] = running - before;
    }

    // Pass 2: scatter offsets and rows to their cursors; one read and one write of every value.
    char* const dst = static_cast<char*>(out_val.data_ptr());
    void* const off_dst = out_off.data_ptr();
#ifdef ZEN_PARTITION_SIMD
    if (simd_scatter) {
        auto vector_scatter = [&](auto id_tag, auto row_bytes_c, auto owners_c) {
            using Id = decltype(id_tag);
            for_each_chunk(chunks, k, [=](int64_t c, int64_t b, int64_t e) {
                simd::scatter_rows_avx512<Id, decltype(row_bytes_c)::value, decltype(owners_c)::value>(
                    pos32, own8, src, b, e, hist_all + c * n, static_cast<Id*>(off_dst), dst);
            });
        };
        auto with_owners = [&](auto id_tag, auto row_bytes_c) {
            static_assert(simd::kMaxScatterOwners == 4, "one case per owner count");
            switch (n) {
                case 1: vector_scatter(id_tag, row_bytes_c, std::integral_constant<int, 1>{}); break;
                case 2: vector_scatter(id_tag, row_bytes_c, std::integral_constant<int, 2>{}); break;
                case 3: vector_scatter(id_tag, row_bytes_c, std::integral_constant<int, 3>{}); break;
                default: vector_scatter(id_tag, row_bytes_c, std::integral_constant<int, 4>{});
            }
        };
        auto with_rows = [&](auto id_tag) {
            if (row_bytes == 4)
                with_owners(id_tag, std::integral_constant<int, 4>{});
            else
                with_owners(id_tag, std::integral_constant<int, 8>{});
        };
        if (int32_ids)
            with_rows(int32_t{});
        else
            with_rows(int64_t{});
        return {counts, out_off, out_val};
    }
#endif
    auto scatter = [&](auto copy, auto id_tag) {
        using Copy = decltype(copy);
        using Id = decltype(id_tag);
        for_each_chunk(chunks, k, [=](int64_t c, int64_t b, int64_t e) {
            int64_t* __restrict cur = hist_all + c * n;
            const uint64_t* __restrict pq = pos;
            const uint32_t* __restrict po = own;
            Id* __restrict od = static_cast<Id*>(off_dst);
            char* const dv = dst;
            const char* const sv = src;
            const int64_t rb = row_bytes;
            for (int64_t i = b; i < e; ++i) {
                const int64_t d = cur[po[i]]++;
                od[d] = static_cast<Id>(pq[i]);
                Copy::run(dv + d * rb, sv + i * rb, rb);
            }
        });
    };
    with_row_copy(row_bytes, [&](auto copy) {
        if (int32_ids)
            scatter(copy, int32_t{});
        else
            scatter(copy, int64_t{});
    });
    return {counts, out_off, out_val};
}

std::tuple<at::Tensor, at::Tensor> aggregate(const at::Tensor& offsets,
                                             const at::Tensor& values,
                                             at::ScalarType accum_dtype,
                                             int64_t terms)
{
    check_ids(offsets, "aggregate offsets");
    TORCH_CHECK(values.device().is_cpu() && values.is_contiguous() && values.dim() == 2 &&
                    values.size(0) == offsets.numel(),
                "zen_ds aggregate: values must be a contiguous CPU tensor [k, row_numel]");
    TORCH_CHECK(accum_dtype == at::kFloat || accum_dtype == at::kDouble,
                "zen_ds aggregate: accum_dtype must be float32 or float64");
    std::tuple<at::Tensor, at::Tensor> result;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_aggregate", [&] {
        if (accum_dtype == at::kFloat)
            result = aggregate_impl<scalar_t, float>(offsets, values, accum_dtype, terms);
        else
            result = aggregate_impl<scalar_t, double>(offsets, values, accum_dtype, terms);
    });
    return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aggregate_bitmap(const at::Tensor& offsets,
                                                                const at::Tensor& values,
                                                                at::ScalarType accum_dtype,
                                                                int64_t universe, int64_t terms)
{
    check_ids(offsets, "aggregate_bitmap offsets");
    TORCH_CHECK(values.device().is_cpu() && values.is_contiguous() && values.dim() == 2 &&
                    values.size(0) == offsets.numel(),
                "zen_ds aggregate_bitmap: values must be a contiguous CPU tensor [k, row_numel]");
    TORCH_CHECK(accum_dtype == at::kFloat || accum_dtype == at::kDouble,
                "zen_ds aggregate_bitmap: accum_dtype must be float32 or float64");
    TORCH_CHECK(universe >= 0, "zen_ds aggregate_bitmap: universe must be >= 0");
    // Every byte is written by aggregate_impl (bits from its bitset, zeros past the last word).
    at::Tensor bitmap = at::empty({(universe + 7) / 8}, offsets.options().dtype(at::kByte));
    uint8_t* bm = bitmap.data_ptr<uint8_t>();
    const int64_t nbytes = bitmap.numel();
    std::tuple<at::Tensor, at::Tensor> result;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_aggregate_bitmap", [&] {
        if (accum_dtype == at::kFloat)
            result = aggregate_impl<scalar_t, float>(offsets, values, accum_dtype, terms, true, bm, nbytes, universe);
        else
            result = aggregate_impl<scalar_t, double>(offsets, values, accum_dtype, terms, true, bm, nbytes, universe);
    });
    return {std::get<0>(result), std::get<1>(result), bitmap};
}

at::Tensor bitmap_encode(const at::Tensor& offsets, int64_t universe)
{
    check_ids(offsets, "bitmap_encode offsets");
    TORCH_CHECK(universe >= 0, "zen_ds bitmap_encode: universe must be >= 0");
    const int64_t k = offsets.numel();
    const int64_t* off = offsets.const_data_ptr<int64_t>();
    at::Tensor out = at::zeros({(universe + 7) / 8}, offsets.options().dtype(at::kByte));
    uint8_t* bits = out.data_ptr<uint8_t>();
    if (k == 0) return out;

    // Validate range and detect sortedness in one parallel pass.
    const int64_t chunks = num_chunks(k, 1 << 14);
    std::vector<char> out_of_range(chunks, 0), unsorted(chunks, 0);
    for_each_chunk(chunks, k, [&](int64_t c, int64_t b, int64_t e) {
        bool bad = false, uns = false;
        for (int64_t i = b; i < e; ++i) {
            bad |= off[i] < 0 || off[i] >= universe;
            uns |= i > 0 && off[i] < off[i - 1];
        }
        out_of_range[c] = bad;
        unsorted[c] = uns;
    });
    for (int64_t c = 0; c < chunks; ++c)
        TORCH_CHECK(!out_of_range[c], "zen_ds bitmap_encode: offsets must lie in [0, universe=",
                    universe, ")");
    const bool sorted = std::none_of(unsorted.begin(), unsorted.end(), [](char x) { return x; });
    if (!sorted) {
        for (int64_t i = 0; i < k; ++i) bits[off[i] >> 3] |= uint8_t(1u << (off[i] & 7));
        return out;
    }
    // Sorted: move chunk borders so that no byte is shared between two threads.
    for_each_chunk(chunks, k, [&](int64_t, int64_t b, int64_t e) {
        // Both borders move to the first index whose byte differs from its predecessor's, so
        // neighbouring chunks agree on the border and never overlap.
        while (b > 0 && b < k && (off[b] >> 3) == (off[b - 1] >> 3)) ++b;
        while (e < k && (off[e] >> 3) == (off[e - 1] >> 3)) ++e;
        for (int64_t i = b; i < e; ++i) bits[off[i] >> 3] |= uint8_t(1u << (off[i] & 7));
    });
    return out;
}

// A bitmap read as 64-bit words: word w holds bits [64w, 64w+64), little-endian, masked to nbits
// (bytes past nbits may hold padding or stray bits and are never read as set).
struct BitmapWords {
    const uint8_t* bytes;
    int64_t nbits, nbytes, nwords;
    BitmapWords(const uint8_t* data, int64_t bits)
        : bytes(data), nbits(bits), nbytes((bits + 7) / 8), nwords((bits + 63) / 64) {}
    uint64_t operator()(int64_t w) const
    {
        uint64_t v = 0;
        const int64_t b0 = w * 8;
        const int64_t take = std::min<int64_t>(8, nbytes - b0);
        if (take == 8)
            std::memcpy(&v, bytes + b0, 8);
        else
            std::memcpy(&v, bytes + b0, static_cast<size_t>(take));
        const int64_t valid = std::min<int64_t>(64, nbits - w * 64);
        if (valid < 64) v &= (1ull << valid) - 1;
        return v;
    }
};

// Exclusive prefix of set bits per chunk of words (for_each_chunk's split): chunk c's first set
// bit is the start[c]-th overall, so chunks can write their decoded rows in parallel.
std::vector<int64_t> set_bits_before_chunks(const BitmapWords& word, int64_t chunks)
{
    std::vector<int64_t> start(chunks + 1, 0);
    for_each_chunk(chunks, word.nwords, [&](int64_t c, int64_t b, int64_t e) {
        int64_t n = 0;
        for (int64_t w = b; w < e; ++w) n += __builtin_popcountll(word(w));
        start[c + 1] = n;
    });
    for (int64_t c = 0; c < chunks; ++c) start[c + 1] += start[c];
    return start;
}

at::Tensor bitmap_decode(const at::Tensor& bitmap, int64_t universe, int64_t count)
{
    TORCH_CHECK(bitmap.device().is_cpu() && bitmap.scalar_type() == at::kByte && bitmap.is_contiguous(),
                "zen_ds bitmap_decode: bitmap must be a contiguous uint8 CPU tensor");
    TORCH_CHECK(universe >= 0, "zen_ds bitmap_decode: universe must be >= 0");
    const BitmapWords word(bitmap.const_data_ptr<uint8_t>(),
                           std::min<int64_t>(bitmap.numel() * 8, universe));
    const int64_t nwords = word.nwords;
    const int64_t chunks = num_chunks(nwords, 1 << 12);
    const std::vector<int64_t> start = set_bits_before_chunks(word, chunks);
    TORCH_CHECK(count < 0 || start[chunks] == count, "zen_ds bitmap_decode: the bitmap has ",
                start[chunks], " set bits but count is ", count, ": a truncated or corrupted payload");
    at::Tensor out = at::empty({start[chunks]}, bitmap.options().dtype(at::kLong));
    int64_t* dst = out.data_ptr<int64_t>();
    for_each_chunk(chunks, nwords, [&](int64_t c, int64_t b, int64_t e) {
        int64_t d = start[c];
        for (int64_t w = b; w < e; ++w) {
            uint64_t v = word(w);
            while (v) {
                dst[d++] = w * 64 + __builtin_ctzll(v);
                v &= v - 1;
            }
        }
    });
    return out;
}

void scatter_rows(at::Tensor& out, const at::Tensor& rows, const at::Tensor& values)
{
    check_ids(rows, "scatter_rows rows");
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 &&
                    values.is_contiguous() && values.dim() == 2 &&
                    values.scalar_type() == out.scalar_type() && values.size(1) == out.size(1) &&
                    values.size(0) == rows.numel(),
                "zen_ds scatter_rows: expected contiguous out [R, W] and values [k, W] of one dtype");
    const int64_t k = rows.numel();
    const int64_t num_rows = out.size(0);
    const int64_t row_bytes = out.size(1) * out.element_size();
    const int64_t* ids = rows.const_data_ptr<int64_t>();
    const char* src = static_cast<const char*>(values.const_data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    std::atomic<bool> bad{false};
    at::parallel_for(0, k, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(row_bytes, 1)),
                     [&](int64_t b, int64_t e) {
                         bool local_bad = false;
                         for (int64_t i = b; i < e; ++i) {
                             const int64_t r = ids[i];
                             if (r < 0 || r >= num_rows) {
                                 local_bad = true;
                                 continue;
                             }
                             copy_row(dst + r * row_bytes, src + i * row_bytes, row_bytes);
                         }
                         if (local_bad) bad.store(true, std::memory_order_relaxed);
                     });
    TORCH_CHECK(!bad.load(), "zen_ds scatter_rows: row ids must lie in [0, ", num_rows, ")");
}


namespace {

// Bitmap shard: bit p set <=> row pi^-1(shard_start + p) is in the shard, its value is the next
// row of `values` (bits ascending). Within one 64-bit word the rows of the set bits are
// row(word base) + b * inverse (mod num_rows): one full unpermute per non-empty word, one add and
// one conditional subtract per set bit.
template <typename Copy>
void scatter_bitmap_shard(char* out, const char* src, int64_t row_bytes, const uint8_t* bytes,
                          int64_t nbits, uint64_t shard_start, const Permutation& p,
                          int64_t expected)
{
    const BitmapWords word(bytes, nbits);
    const int64_t nwords = word.nwords;
    const uint64_t N = p.rows.d;
    uint64_t step[64];  // b * inverse mod N
    for (int b = 0; b < 64; ++b) step[b] = mulmod(static_cast<uint64_t>(b) % N, p.inverse, p.rows);
    const int64_t chunks = num_chunks(nwords, 1 << 12);
    const std::vector<int64_t> start = set_bits_before_chunks(word, chunks);
    TORCH_CHECK(start[chunks] == expected, "zen_ds scatter_shard: the bitmap has ", start[chunks],
                " set bits but values has ", expected, " rows");
    // The rows land anywhere in the dense output (that is what the permutation is for), so
    // nearly every store misses the cache: rows are computed kRing ahead of their copy and their
    // destination prefetched for writing, keeping many misses in flight.
    constexpr int64_t kRing = 32;  // power of two
    for_each_chunk(chunks, nwords, [&](int64_t c, int64_t b, int64_t e) {
        int64_t d = start[c];  // value row of the next copy
        int64_t ring[kRing];
        int64_t pushed = 0, popped = 0;
        for (int64_t w = b; w < e; ++w) {
            uint64_t v = word(w);
            if (!v) continue;
            const uint64_t base = unpermute_one(shard_start + static_cast<uint64_t>(w) * 64, p);
            while (v) {
                uint64_t row = base + step[__builtin_ctzll(v)];
                row -= row >= N ? N : 0;
                char* target = out + static_cast<int64_t>(row) * row_bytes;
                __builtin_prefetch(target, 1, 1);
                if (pushed - popped == kRing) {
                    Copy::run(out + ring[popped & (kRing - 1)] * row_bytes, src + d * row_bytes,
                              row_bytes);
                    ++d;
                    ++popped;
                }
                ring[pushed & (kRing - 1)] = static_cast<int64_t>(row);
                ++pushed;
                v &= v - 1;
            }
        }
        for (; popped < pushed; ++popped, ++d)
            Copy::run(out + ring[popped & (kRing - 1)] * row_bytes, src + d * row_bytes, row_bytes);
    });
}

template <typename Copy, typename Id>
bool scatter_coo_shard(char* out, const char* src, int64_t row_bytes, const Id* off, int64_t k,
                       int64_t universe, uint64_t shard_start, const Permutation& p)
{
    std::atomic<bool> bad{false};
    at::parallel_for(0, k, std::max<int64_t>(1 << 12, (1 << 16) / std::max<int64_t>(row_bytes, 1)),
                     [&](int64_t b, int64_t e) {
                         bool local_bad = false;
                         for (int64_t i = b; i < e; ++i) {
                             const int64_t o = static_cast<int64_t>(off[i]);
                             if (o < 0 || o >= universe) {
                                 local_bad = true;
                                 continue;
                             }
                             const uint64_t row = unpermute_one(shard_start + static_cast<uint64_t>(o), p);
                             Copy::run(out + static_cast<int64_t>(row) * row_bytes, src + i * row_bytes,
                                       row_bytes);
                         }
                         if (local_bad) bad.store(true, std::memory_order_relaxed);
                     });
    return !bad.load();
}

}  // namespace

void scatter_shard(at::Tensor& out, const at::Tensor& index, const at::Tensor& values, bool bitmap,
                   int64_t universe, int64_t shard_start, const PermArgs& perm)
{
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 &&
                    values.device().is_cpu() && values.is_contiguous() && values.dim() == 2 &&
                    values.scalar_type() == out.scalar_type() && values.size(1) == out.size(1),
                "zen_ds scatter_shard: expected contiguous CPU out [R, W] and values [k, W] of one dtype");
    TORCH_CHECK(index.device().is_cpu() && index.is_contiguous(),
                "zen_ds scatter_shard: index must be a contiguous CPU tensor");
    TORCH_CHECK(out.size(0) == perm.num_rows, "zen_ds scatter_shard: out has ", out.size(0),
                " rows but num_rows is ", perm.num_rows);
    TORCH_CHECK(universe >= 0 && shard_start >= 0 && shard_start + universe <= perm.num_rows,
                "zen_ds scatter_shard: shard [", shard_start, ", ", shard_start + universe,
                ") outside [0, num_rows=", perm.num_rows, ")");
    const Permutation p = make_perm(perm, 1);
    const int64_t k = values.size(0);
    const int64_t row_bytes = out.size(1) * out.element_size();
    char* dst = static_cast<char*>(out.data_ptr());
    const char* src = static_cast<const char*>(values.const_data_ptr());
    const uint64_t start = static_cast<uint64_t>(shard_start);
    if (bitmap) {
        TORCH_CHECK(index.scalar_type() == at::kByte, "zen_ds scatter_shard: a bitmap must be uint8");
        const int64_t nbits = std::min<int64_t>(index.numel() * 8, universe);
        with_row_copy(row_bytes, [&](auto copy) {
            scatter_bitmap_shard<decltype(copy)>(dst, src, row_bytes, index.const_data_ptr<uint8_t>(),
                                                 nbits, start, p, k);
        });
        return;
    }
    TORCH_CHECK(index.numel() == k, "zen_ds scatter_shard: ", index.numel(), " offsets but values has ",
                k, " rows");
    TORCH_CHECK(index.scalar_type() == at::kInt || index.scalar_type() == at::kLong,
                "zen_ds scatter_shard: COO offsets must be int32 or int64");
    bool ok = true;
    with_row_copy(row_bytes, [&](auto copy) {
        using Copy = decltype(copy);
        ok = index.scalar_type() == at::kInt
                 ? scatter_coo_shard<Copy, int32_t>(dst, src, row_bytes, index.const_data_ptr<int32_t>(),
                                                    k, universe, start, p)
                 : scatter_coo_shard<Copy, int64_t>(dst, src, row_bytes, index.const_data_ptr<int64_t>(),
                                                    k, universe, start, p);
    });
    TORCH_CHECK(ok, "zen_ds scatter_shard: offsets must lie in [0, universe=", universe, ")");
}

}  // namespace cpu
}  // namespace zen
