// zen_ds: owner permutation and exact 64-bit modular arithmetic, shared by host and device code.
//
// The permutation is pi(row) = (row * multiplier + offset) mod num_rows (num_rows <= 2**48); its
// parameters are computed once in Python (zen_ds/ops/torch_ops.py::permutation_params) and passed
// in, so every implementation agrees bit for bit. Divisions are replaced by Barrett reduction with a
// precomputed reciprocal: a hardware 64-bit divide costs tens of cycles on a CPU and is emulated on
// a GPU, and the ops run it once or twice per non-zero row.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ZEN_HD __host__ __device__ __forceinline__
#else
#define ZEN_HD inline
#endif

namespace zen {

constexpr int kLimbBits = 12;                    // same limb width as the torch reference
constexpr uint64_t kLimbMask = (1ull << kLimbBits) - 1;
constexpr uint64_t kMaxNumRows = 1ull << 48;

// High 64 bits of a 64x64-bit product.
ZEN_HD uint64_t mulhi64(uint64_t a, uint64_t b)
{
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __umul64hi(a, b);
#else
    return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// Exact division by a fixed divisor d >= 1 for any 64-bit numerator.
// reciprocal = floor((2**64 - 1) / d); the quotient estimate is at most 2 too small.
struct Divisor {
    uint64_t d;
    uint64_t reciprocal;
};

inline Divisor make_divisor(uint64_t d) { return Divisor{d, ~0ull / d}; }

ZEN_HD uint64_t div_rem(uint64_t a, const Divisor& div, uint64_t* rem)
{
    uint64_t q = mulhi64(a, div.reciprocal);
    uint64_t r = a - q * div.d;  // exact: q * d <= a, and r < 3 * d
    // Two branch-free corrections (conditional moves): the estimate's error is data-dependent,
    // so a loop here mispredicts often.
    const bool over1 = r >= div.d;
    r -= over1 ? div.d : 0;
    q += over1;
    const bool over2 = r >= div.d;
    r -= over2 ? div.d : 0;
    q += over2;
    *rem = r;
    return q;
}

ZEN_HD uint64_t mod(uint64_t a, const Divisor& div)
{
    uint64_t r;
    div_rem(a, div, &r);
    return r;
}

// Everything a kernel needs to map a row id to (owner rank, shard-relative position) and back.
struct Permutation {
    Divisor rows;        // num_rows
    Divisor world;       // world_size (1 when unused)
    uint64_t multiplier; // < num_rows
    uint64_t inverse;    // multiplier**-1 mod num_rows
    uint64_t offset;     // < num_rows
    uint64_t world_size;
};

inline Permutation make_permutation(uint64_t num_rows, uint64_t multiplier, uint64_t inverse,
                                    uint64_t offset, uint64_t world_size)
{
    return Permutation{make_divisor(num_rows), make_divisor(world_size ? world_size : 1),
                       multiplier, inverse, offset, world_size ? world_size : 1};
}

// (x * factor) mod n for x, factor < n <= 2**48. One Barrett step when the product fits 64 bits,
// else Horner over 12-bit limbs of factor (every partial value < 2**61), like the torch reference.
ZEN_HD uint64_t mulmod(uint64_t x, uint64_t factor, const Divisor& n)
{
    if (n.d <= (1ull << 32)) return mod(x * factor, n);
    uint64_t acc = 0;
    for (int shift = 36; shift >= 0; shift -= kLimbBits) {
        const uint64_t limb = (factor >> shift) & kLimbMask;
        acc = mod((acc << kLimbBits) + x * limb, n);
    }
    return acc;
}

// pi(row): position of a row id (0 <= row < num_rows) in permuted space.
ZEN_HD uint64_t permute_one(uint64_t row, const Permutation& p)
{
    const uint64_t t = mulmod(row, p.multiplier, p.rows) + p.offset;  // < 2 * num_rows
    return t >= p.rows.d ? t - p.rows.d : t;
}

// pi^-1(position): the row id at a permuted position (0 <= position < num_rows).
ZEN_HD uint64_t unpermute_one(uint64_t position, const Permutation& p)
{
    const uint64_t shifted =
        position >= p.offset ? position - p.offset : position + p.rows.d - p.offset;
    return mulmod(shifted, p.inverse, p.rows);
}

// Owner rank of permuted position q: the r with floor(r*N/n) <= q < floor((r+1)*N/n),
// i.e. floor(((q + 1) * n - 1) / N). Also returns q minus the owner's shard start.
// Requires num_rows * world_size < 2**64 (checked on the host).
ZEN_HD uint64_t owner_of(uint64_t q, const Permutation& p, uint64_t* shard_offset)
{
    uint64_t unused;
    const uint64_t owner = div_rem((q + 1) * p.world_size - 1, p.rows, &unused);
    const uint64_t start = div_rem(owner * p.rows.d, p.world, &unused);
    *shard_offset = q - start;
    return owner;
}

}  // namespace zen
