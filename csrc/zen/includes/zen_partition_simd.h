// zen_ds: AVX-512 kernels of the CPU partition op (csrc/zen/cpu/zen_ops_cpu.cpp).
//
// They map 8 row ids per instruction to (owner, shard offset) and, for narrow rows, scatter 16 rows
// at a time with in-register compress + masked stores (compress straight to memory is microcoded
// and slow on Zen 4). Compiled with target attributes and chosen at run time (avx512_usable), so
// the library still runs on CPUs without AVX-512; the scalar code in partition stays the
// reference and handles whatever these preconditions exclude.
//
// Exactness. Preconditions: N = num_rows < 2**32, n = world_size < 2**32, N * n <= 2**52, ids < N;
// so every product below has factors < 2**32 (vpmuludq, exact) and every double is exact or
// carries the stated rounding. Each quotient is estimated in doubles, rounded to nearest (adding
// 2**52), then corrected once:
// * q = (x * m + offset) mod N, x, m, offset < N: t = x * m + offset <= N * (N - 1) < 2**64.
//   Q = t / N < N is estimated by fma(x, fl(m / N), fl(offset / N)): three roundings of relative
//   size <= 2**-53, so the error is < 2**-20 and round(estimate) is floor(Q) or floor(Q) + 1
//   (<= N < 2**32). r = t - qhat * N then lies in [-N, N) and one conditional add of N gives q.
// * Owner floor(A / N), A = (q + 1) * n - 1 < N * n <= 2**52 (exact as a double), estimated by
//   A * fl(1 / N) (error <= n * 2**-52 < 2**-20), and for n > 16 the shard start
//   floor(o * N / n) (o * N < N * n, error <= N * 2**-52 < 2**-20): the same single correction.
// Every other operation is an exact integer one, so the results equal zen_permute.h's bit for bit.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ZEN_PARTITION_SIMD 1
#include <immintrin.h>
#endif

namespace zen {
namespace cpu {
namespace simd {

// Per-call constants of the permutation and the shard layout.
struct PartitionParams {
    uint64_t num_rows;
    uint64_t multiplier;
    uint64_t offset;
    uint64_t world_size;
    const uint64_t* starts;  // world_size + 1 shard starts floor(r * N / n)
};

// Widest world_size the scatter kernel takes: its cost grows with n (one compress + masked store
// of each 16-row block per owner): at 8 owners the scalar scatter is already faster.
constexpr uint64_t kMaxScatterOwners = 4;

inline bool params_fit(const PartitionParams& p)
{
    return p.num_rows < (1ull << 32) && p.world_size < (1ull << 32) &&
           static_cast<unsigned __int128>(p.num_rows) * p.world_size <= (1ull << 52);
}

#ifdef ZEN_PARTITION_SIMD

#define ZEN_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))

inline bool avx512_usable()
{
    static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
    return ok;
}

constexpr int64_t kMagic = 0x4330000000000000;  // bits of 2**52

// double(v) for 0 <= v < 2**52: v in the mantissa of 2**52 + v, exact; no vcvtuqq2pd (slow).
ZEN_AVX512 inline __m512d to_double(__m512i v)
{
    return _mm512_sub_pd(_mm512_castsi512_pd(_mm512_or_si512(v, _mm512_set1_epi64(kMagic))),
                         _mm512_set1_pd(0x1p52));
}

// Round to nearest for 0 <= e < 2**51: the low 32 bits of the result are the integer (for
// integers < 2**32, which is all vpmuludq reads), the high bits are junk.
ZEN_AVX512 inline __m512i round_low32(__m512d e)
{
    return _mm512_castpd_si512(_mm512_add_pd(e, _mm512_set1_pd(0x1p52)));
}

// floor(a / d) (low 32 bits) from an estimate qhat in {floor, floor + 1}, r = a - qhat * d.
ZEN_AVX512 inline __m512i fix_quotient(__m512i qhat, __m512i r)
{
    return _mm512_mask_sub_epi64(qhat, _mm512_cmplt_epi64_mask(r, _mm512_setzero_si512()), qhat,
                                 _mm512_set1_epi64(1));
}

// The broadcast constants of one call; built inside the kernels (AVX-512 values never cross a
// non-AVX-512 function boundary).
struct Mapper {
    __m512i rows, mult, offset, world, world_m1, starts_lo, starts_hi;
    __m512d mult_scale, offset_scale, inv_rows, inv_world;
    bool table;  // shard starts from two registers (n <= 16) instead of computed

    ZEN_AVX512 explicit Mapper(const PartitionParams& p)
    {
        rows = _mm512_set1_epi64(static_cast<int64_t>(p.num_rows));
        mult = _mm512_set1_epi64(static_cast<int64_t>(p.multiplier));
        offset = _mm512_set1_epi64(static_cast<int64_t>(p.offset));
        world = _mm512_set1_epi64(static_cast<int64_t>(p.world_size));
        world_m1 = _mm512_set1_epi64(static_cast<int64_t>(p.world_size - 1));
        const double n_rows = static_cast<double>(p.num_rows);
        mult_scale = _mm512_set1_pd(static_cast<double>(p.multiplier) / n_rows);
        offset_scale = _mm512_set1_pd(static_cast<double>(p.offset) / n_rows);
        inv_rows = _mm512_set1_pd(1.0 / n_rows);
        inv_world = _mm512_set1_pd(1.0 / static_cast<double>(p.world_size));
        table = p.world_size <= 16;
        int64_t lo[8] = {}, hi[8] = {};
        for (uint64_t r = 0; r < p.world_size && r < 16; ++r)
            (r < 8 ? lo[r] : hi[r - 8]) = static_cast<int64_t>(p.starts[r]);
        starts_lo = _mm512_loadu_si512(lo);
        starts_hi = _mm512_loadu_si512(hi);
    }

    // Owner and shard offset of K blocks of 8 ids, each < num_rows, one step at a time across the
    // blocks: a block is a long chain of dependent operations, and the scheduler only sees about
    // one block ahead. Every factor of vpmuludq is < 2**32.
    template <int K>
    ZEN_AVX512 inline void map(const __m512i* x, __m512i* owner, __m512i* shard_offset) const
    {
        const __m512i zero = _mm512_setzero_si512();
        __m512i t[K], q[K], a[K], o[K];
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j) {
            t[j] = _mm512_add_epi64(_mm512_mul_epu32(x[j], mult), offset);
            q[j] = round_low32(_mm512_fmadd_pd(to_double(x[j]), mult_scale, offset_scale));
        }
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j) q[j] = _mm512_sub_epi64(t[j], _mm512_mul_epu32(q[j], rows));
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j)
            q[j] = _mm512_mask_add_epi64(q[j], _mm512_cmplt_epi64_mask(q[j], zero), q[j], rows);
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j) {
            a[j] = _mm512_add_epi64(_mm512_mul_epu32(q[j], world), world_m1);
            o[j] = round_low32(_mm512_mul_pd(to_double(a[j]), inv_rows));
        }
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j)
            o[j] = fix_quotient(o[j], _mm512_sub_epi64(a[j], _mm512_mul_epu32(o[j], rows)));
        if (table) {
#pragma GCC unroll 8
            for (int j = 0; j < K; ++j)  // the permute reads index bits 0-3 only
                shard_offset[j] =
                    _mm512_sub_epi64(q[j], _mm512_permutex2var_epi64(starts_lo, o[j], starts_hi));
        } else {
#pragma GCC unroll 8
            for (int j = 0; j < K; ++j) {
                const __m512i b = _mm512_mul_epu32(o[j], rows);
                const __m512i s = round_low32(_mm512_mul_pd(to_double(b), inv_world));
                const __m512i start = _mm512_and_si512(
                    fix_quotient(s, _mm512_sub_epi64(b, _mm512_mul_epu32(s, world))),
                    _mm512_set1_epi64(0xffffffff));
                shard_offset[j] = _mm512_sub_epi64(q[j], start);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j) owner[j] = _mm512_and_si512(o[j], _mm512_set1_epi64(0xffffffff));
    }
};

// Mask of lanes [0, count) of an 8-lane block (count clamped to [0, 8]).
inline __mmask8 lanes8(int64_t count)
{
    return count >= 8 ? 0xff : count <= 0 ? 0 : static_cast<__mmask8>((1u << count) - 1);
}

// Per-owner counts of 8-lane owner vectors, for n <= 16: byte o of a 64-bit lane counts owner o
// (o < 8 in `lo`, o - 8 in `hi`; vpsllvq gives 0 for shifts >= 64), flushed before a byte can wrap.
struct OwnerHistogram {
    __m512i lo, hi;
    int pending = 0;
    int64_t* hist;
    uint64_t n;

    ZEN_AVX512 OwnerHistogram(int64_t* h, uint64_t world) : hist(h), n(world)
    {
        lo = hi = _mm512_setzero_si512();
    }

    ZEN_AVX512 inline void add(__m512i owner, __mmask8 valid)
    {
        const __m512i one = _mm512_set1_epi64(1);
        const __m512i shift = _mm512_slli_epi64(owner, 3);
        lo = _mm512_add_epi64(lo, _mm512_maskz_sllv_epi64(valid, one, shift));
        if (n > 8)
            hi = _mm512_add_epi64(hi, _mm512_maskz_sllv_epi64(
                                          valid, one, _mm512_sub_epi64(shift, _mm512_set1_epi64(64))));
        if (++pending == 255) flush();
    }

    ZEN_AVX512 void flush()
    {
        alignas(64) uint64_t l[8], h[8];
        _mm512_store_si512(l, lo);
        _mm512_store_si512(h, hi);
        for (uint64_t o = 0; o < n; ++o) {
            const uint64_t* src = o < 8 ? l : h;
            const int sh = static_cast<int>(o & 7) * 8;
            int64_t sum = 0;
            for (int j = 0; j < 8; ++j) sum += (src[j] >> sh) & 0xff;
            hist[o] += sum;
        }
        lo = hi = _mm512_setzero_si512();
        pending = 0;
    }
};

// The low 32 bits of 8 lanes. A permute, not vpmovqd: the compiler folds vpmovqd into a
// narrowing store, which Zen 4 runs as microcode.
ZEN_AVX512 inline __m256i low_halves(__m512i v)
{
    return _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), v));
}

// Pass 1 over rows [b, e): owner histogram into hist[n], every row's shard offset into pos and
// owner into own (Pos: uint64_t or uint32_t, the latter only when shard offsets fit; Own: uint32_t
// or uint8_t, the latter for n <= 256). Returns false if an id is >= num_rows (counted as id 0).
template <typename Pos, typename Own>
ZEN_AVX512 bool map_rows_avx512(const uint64_t* ids, int64_t b, int64_t e, const PartitionParams& p,
                                int64_t* hist, Pos* pos, Own* own)
{
    static_assert(sizeof(Pos) == 8 || sizeof(Pos) == 4, "uint64_t or uint32_t offsets");
    static_assert(sizeof(Own) == 4 || sizeof(Own) == 1, "uint32_t or uint8_t owners");
    constexpr int K = 4;  // blocks of 8 rows mapped together
    const Mapper m(p);
    const bool small = p.world_size <= 16;
    OwnerHistogram counter(hist, p.world_size);
    __mmask8 bad = 0;
    for (int64_t i = b; i < e; i += 8 * K) {
        __mmask8 valid[K];
        __m512i x[K], o[K], s[K];
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j) {
            valid[j] = lanes8(e - i - 8 * j);
            x[j] = _mm512_maskz_loadu_epi64(valid[j], ids + i + 8 * j);
            const __mmask8 out = _mm512_cmpge_epu64_mask(x[j], m.rows);
            bad |= out;
            x[j] = _mm512_maskz_mov_epi64(static_cast<__mmask8>(~out), x[j]);
        }
        m.map<K>(x, o, s);
#pragma GCC unroll 8
        for (int j = 0; j < K; ++j) {
            const int64_t at = i + 8 * j;
            if constexpr (sizeof(Pos) == 8)
                _mm512_mask_storeu_epi64(pos + at, valid[j], s[j]);
            else
                _mm256_mask_storeu_epi32(pos + at, valid[j], low_halves(s[j]));
            if constexpr (sizeof(Own) == 4)
                _mm256_mask_storeu_epi32(own + at, valid[j], low_halves(o[j]));
            else
                _mm_mask_storeu_epi8(own + at, valid[j], _mm512_cvtepi64_epi8(o[j]));
            if (small) counter.add(o[j], valid[j]);
        }
    }
    if (small) {
        counter.flush();
    } else {
        // Reading the lanes back right after a vector store would stall on store forwarding.
        for (int64_t i = b; i < e; ++i) ++hist[own[i]];
    }
    return bad == 0;
}

// Pass 2 over rows [b, e) for kOwners = n <= kMaxScatterOwners and rows of kRowBytes (4 or 8)
// bytes, from map_rows_avx512's uint32_t offsets and uint8_t owners: each 16-row block's rows of
// owner r go, in order, to cur[r] (stable) by a compress in a register and a masked store.
template <typename Id, int kRowBytes, int kOwners>
ZEN_AVX512 void scatter_rows_avx512(const uint32_t* pos, const uint8_t* own, const char* src,
                                    int64_t b, int64_t e, int64_t* cur, Id* off_dst, char* val_dst)
{
    static_assert(kRowBytes == 4 || kRowBytes == 8, "rows of 4 or 8 bytes");
    int64_t c[kOwners];
    for (int r = 0; r < kOwners; ++r) c[r] = cur[r];
    for (int64_t i = b; i < e; i += 16) {
        const __mmask8 vlo = lanes8(e - i);
        const __mmask8 vhi = lanes8(e - i - 8);
        const __mmask16 valid = static_cast<__mmask16>(vlo | (static_cast<unsigned>(vhi) << 8));
        const __m512i owner = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, own + i));
        const __m512i off32 = _mm512_maskz_loadu_epi32(valid, pos + i);
        __m512i v32 = off32, vlo64 = off32, vhi64 = off32;
        if constexpr (kRowBytes == 4) {
            v32 = _mm512_maskz_loadu_epi32(valid, src + i * 4);
        } else {
            vlo64 = _mm512_maskz_loadu_epi64(vlo, src + i * 8);
            vhi64 = _mm512_maskz_loadu_epi64(vhi, src + i * 8 + 64);
        }
        __m512i olo = off32, ohi = off32;
        if constexpr (sizeof(Id) == 8) {
            olo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(off32));
            ohi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(off32, 1));
        }
#pragma GCC unroll 8
        for (int r = 0; r < kOwners; ++r) {
            const __mmask16 k = _mm512_mask_cmpeq_epi32_mask(valid, owner, _mm512_set1_epi32(r));
            const int count = __builtin_popcount(k);
            const int64_t d = c[r];
            c[r] = d + count;
            const __mmask16 head = static_cast<__mmask16>((1u << count) - 1);
            const __mmask8 klo = static_cast<__mmask8>(k), khi = static_cast<__mmask8>(k >> 8);
            const int count_lo = __builtin_popcount(klo);
            if constexpr (sizeof(Id) == 4) {
                _mm512_mask_storeu_epi32(off_dst + d, head, _mm512_maskz_compress_epi32(k, off32));
            } else {
                _mm512_mask_storeu_epi64(off_dst + d, lanes8(count_lo),
                                         _mm512_maskz_compress_epi64(klo, olo));
                _mm512_mask_storeu_epi64(off_dst + d + count_lo, lanes8(count - count_lo),
                                         _mm512_maskz_compress_epi64(khi, ohi));
            }
            if constexpr (kRowBytes == 4) {
                _mm512_mask_storeu_epi32(val_dst + d * 4, head, _mm512_maskz_compress_epi32(k, v32));
            } else {
                _mm512_mask_storeu_epi64(val_dst + d * 8, lanes8(count_lo),
                                         _mm512_maskz_compress_epi64(klo, vlo64));
                _mm512_mask_storeu_epi64(val_dst + (d + count_lo) * 8, lanes8(count - count_lo),
                                         _mm512_maskz_compress_epi64(khi, vhi64));
            }
        }
    }
    for (int r = 0; r < kOwners; ++r) cur[r] = c[r];
}

#undef ZEN_AVX512

#endif  // ZEN_PARTITION_SIMD

}  // namespace simd
}  // namespace cpu
}  // namespace zen
