// Shared math for the CPU and CUDA kernels of gact-kernels.
//
// NOTE [storage and RNG invariants]
// Everything that decides a stored byte or a restored value lives in this header, compiled by
// gcc for the CPU module and by nvcc for the CUDA module, so the two cannot drift:
//  * Element order: e is the index of an element in memory order. The wrapper hands the kernels
//    the storage of a non-overlapping, dense tensor as it lies in memory (any dimension order:
//    contiguous, channels-last, permuted) and stores its strides; other inputs are copied
//    contiguous first. Every format below is a function of this flat sequence.
//  * Groups: element e belongs to group e / G (G = group size, a multiple of 8). Per group the
//    quantiser stores float32 `lo` and float32 `scale`.
//  * Packing: element e is stored in bits [e*b, (e+1)*b) of one little-endian bitstream of
//    ceil(n*b/8) bytes. As G*b is a multiple of 8 every group starts on a byte boundary, and
//    8 consecutive elements (a "chunk") always fill exactly b bytes.
//  * Quantisation, all in IEEE fp32 with round-to-nearest and no contraction (host:
//    -ffp-contract=off; device: __f*_rn intrinsics):
//      lo = min(x) + 0, hi = max(x) + 0 (the "+ 0" maps -0 to +0), scale = (hi - lo) / (2^b - 1),
//      q = trunc(min((x - lo) / scale + u, 2^b - 1)), level(q) = lo + q * scale.
//    (x - lo) / scale + u >= 0, so truncation equals floor. scale == 0 stores q = 0.
//  * A group is "flagged" (lo = 0, scale = NaN, q = 0; the wrapper stores its elements
//    losslessly) if it holds NaN/Inf, if hi - lo overflows, or if hi - lo > 0 and
//    scale < FLT_MIN = 2^-126. The last rule keeps every coded group's scale a normal float,
//    within a relative 2^-24 of (hi - lo) / (2^b - 1). A subnormal scale has fewer significant
//    bits: rounded down, its grid stops short of hi and the elements above it are clamped
//    (biased); rounded to 0, the whole group would come back as lo.
//  * Zero-exact grid (quantize(..., zero_exact=True), bits >= 2; the container records the
//    mode). Which groups: those not flagged whose lo is +0 (bit pattern 0x00000000, i.e. the
//    minimum is a zero of either sign; for a non-negative input, every group holding a zero).
//    Every other group (lo < 0, lo > 0, flagged) is coded exactly as above, and so is the
//    flag rule (it still uses (hi - lo) / (2^b - 1)): `nbytes` never changes with the mode.
//    With D = 2^b - 2 and tiny the smallest positive normal number of the *input* dtype
//    (2^-126 for fp32 and bf16, 2^-14 for fp16; normal, so that flush-to-zero arithmetic
//    downstream cannot turn it into 0), in the same fp32 arithmetic:
//      scale = step = max(hi - tiny, 0) / D              (f_sub, f_max with +0, f_div),
//      x > 0:   q = 1 + trunc(min(max(x - tiny, 0) / s + u, D)), s = step > 0 ? step : 1,
//      else:    q = 0  (x is +0 or -0: code 0 means exactly 0),
//      level(0) = +0, level(q >= 1) = tiny + float(q - 1) * step, clamped to FLT_MAX.
//    u is the element's usual 24-bit noise. A positive element below tiny always gets code 1,
//    the level tiny (a bias in (0, tiny)); one >= tiny is rounded unbiasedly between the
//    levels tiny + k * step, k = 0 .. D. step == 0 only when hi <= tiny: every positive is
//    then <= tiny, max(x - tiny, 0) = 0, and dividing by s = 1 gives k = 0 (code 1) instead of
//    0/0. For fp32/bf16 a coded group with lo = 0 has fl(hi / (2^b - 1)) >= 2^-126, and every
//    such hi gives step >= 2^-126 (checked at the smallest such hi for every width, in
//    tests/test_zero_exact.py; both conditions are monotone in hi), so the step is a normal
//    float and no further lossless rule is needed. For fp16, hi > tiny gives step >= 2^-32
//    (fp16 values above 2^-14 lie at least 2^-24 apart); hi <= tiny gives step = 0.
//    Decoding reads the mode and lo only: with the mode on, a group whose lo is +0 (bit
//    pattern) is decoded on this grid. Constant zero groups (lo = +0, step 0, all codes 0)
//    come back as 0 either way; flagged groups also store lo = +0 and come back as 0 here,
//    then the wrapper overwrites them. Every positive level is >= tiny, and tiny lies on the
//    fp16 and bf16 grids, so the stochastic output rounding below (which picks one of the two
//    neighbours on the output grid) never takes a positive level below tiny, let alone to 0.
//  * Dequantisation: v = level(q), clamped to [-FLT_MAX, FLT_MAX] (a level can round past the
//    largest float when hi is close to it). fp32 output: v (round to nearest in the fp32
//    arithmetic above). fp16/bf16 output: v rounded *stochastically* to the output grid, so
//    that E[output] = E[v]. With a = |v|'s bits and h = hash32 of the dequantisation stream:
//      bf16: r = (a + (h >> 16)) >> 16 (16 random bits added to the 16 discarded bits: the
//            magnitude rounds up with probability (a & 0xFFFF) / 2^16, exactly).
//      fp16, |v| >= 2^-14: r = (a - (112 << 23) + (h >> 19)) >> 13 (rebias; 13 random bits).
//      fp16, |v| <  2^-14 (subnormal grid, step 2^-24): t = |v| * 2^24 (exact), k = trunc(t),
//            F = trunc((t - k) * 2^32) (exact when |v| >= 2^-33), r = k + (h > ~F), i.e. up
//            with probability F / 2^32: exactly unbiased down to 2^-33, below that the
//            up-probability is short by < 2^-32 (a bias < 2^-56 in absolute value).
//      The sign of v is kept; r is capped at the largest finite value (0x7F7F bf16, 0x7BFF
//      fp16), so a finite level never becomes Inf; NaN (flagged groups only, overwritten by
//      the wrapper) becomes the canonical NaN.
//  * RNG: counter-based, a pure function of (key, e). Per call mix64 is the splitmix64
//    finaliser; the quantisation key is K = mix64(seed + GAMMA), the dequantisation key
//    mix64(K); (k0, k1) are the low/high 32 bits of a key. Per element, in uint32 arithmetic:
//      h = ((lo32(e) * 0x9E3779B1) ^ (hi32(e) * 0x85EBCA77 + k1)) + k0, then the lowbias32
//      finaliser (h ^= h>>16; h *= 0x7FEB352D; h ^= h>>15; h *= 0x846CA68B; h ^= h>>16).
//    Quantisation uses u = (h >> 8) * 2^-24 (24 random bits, exact in fp32); dequantisation
//    uses the bits of h named above. Nothing depends on threads, blocks, streams or devices.
//  * Integer packing (pack_ints; lossless): values are read as int64 (sign- or zero-extended).
//    Per group: mn = min, w = bit width of the uint64 difference max - mn (0..64; 0 when the
//    group is constant), code(x) = uint64(x) - uint64(mn) mod 2^64 < 2^w. Group g occupies
//    bytes [start_g, start_g + ceil(m_g * w_g / 8)) with m_g its element count and start_g the
//    sum of the byte counts of the groups before it; inside, code j is bits [j*w, (j+1)*w) of
//    a little-endian bitstream, padding bits are 0. A chunk of 8 codes fills exactly w bytes.
//  * Rotation (rotate / unrotate; block B a power of two in [2, kMaxRotationBlock]): element e
//    of the first n - n % B lies in block e / B at position i = e % B; the tail is not rotated.
//    Sign s(i) = -1 if hash32 of the quantisation stream of seed kSignSeed at index i has its
//    top bit set, else +1. rotate reads x in its dtype and writes float32
//      y = H (s * x) per block, by the butterflies: for h = 1, 2, 4, ..., B/2, for every k with
//      k & h == 0: (y[k], y[k + h]) = (y[k] + y[k + h], y[k] - y[k + h]), in IEEE fp32;
//    the tail is copied (as float32). unrotate reads float32 y, applies the same butterflies
//    to each block, then v = s * (y * (1 / B)) (exact but for subnormals), and writes v in its
//    output dtype: float32 as it is, float16/bfloat16 rounded stochastically as dequantised
//    values are, with h from the rotation stream of its seed, key mix64(mix64(mix64(seed +
//    GAMMA))), at index e; the tail is written the same way. H is the Sylvester-Hadamard
//    matrix (H H = B I), so unrotate(rotate(x)) = x up to fp32 rounding.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>

#if defined(__CUDACC__)
#define GACT_HD __host__ __device__ __forceinline__
#else
#define GACT_HD inline __attribute__((always_inline))
#endif

namespace gact {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
constexpr uint32_t kLowMul = 0x9E3779B1u;
constexpr uint32_t kHighMul = 0x85EBCA77u;
constexpr uint32_t kFin1 = 0x7FEB352Du;
constexpr uint32_t kFin2 = 0x846CA68Bu;
constexpr int kChunk = 8;  // elements per chunk; a chunk of b-bit codes is exactly b bytes
constexpr float kFloatMax = 3.4028234663852886e+38f;
constexpr float kFloatMin = 1.1754943508222875e-38f;  // smallest normal float, 2^-126

// One code per dtype understood by the kernels (the Python wrapper holds the same table).
enum DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kUInt8 = 3,
  kInt8 = 4,
  kInt16 = 5,
  kInt32 = 6,
  kInt64 = 7,
};

// ---- exact IEEE fp32 arithmetic, identical on host and device -------------------------------
GACT_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GACT_HD float f_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
GACT_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GACT_HD float f_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
GACT_HD uint32_t f_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
GACT_HD float f_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
GACT_HD float f_min(float a, float b) { return a < b ? a : b; }
GACT_HD float f_max(float a, float b) { return a > b ? a : b; }
GACT_HD uint32_t is_nonfinite(float f) { return (f_bits(f) & 0x7F800000u) == 0x7F800000u; }

// ---- dtype conversions (exact widening; narrowing to half/bfloat16 is stochastic) ------------
GACT_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  // Shift exponent+mantissa into place and rebias by multiplying with 2^(127-15): exact for
  // normal and subnormal halves. Inf/NaN (exponent all ones) get the float exponent forced.
  uint32_t r = f_bits(f_mul(f_from_bits(em << 13), 5.192296858534828e+33f /* 2^112 */));
  r = em >= 0x7C00u ? (r | 0x7F800000u) : r;
  return f_from_bits(r | sign);
}
GACT_HD float bf16_to_float(uint16_t h) { return f_from_bits(static_cast<uint32_t>(h) << 16); }

// Stochastic rounding of v to bfloat16 with the random word h (NOTE [storage and RNG
// invariants], "Dequantisation").
GACT_HD uint16_t float_to_bf16_stochastic(float v, uint32_t h) {
  const uint32_t x = f_bits(v);
  const uint32_t a = x & 0x7FFFFFFFu;
  uint32_t r = (a + (h >> 16)) >> 16;
  r = r > 0x7F7Fu ? 0x7F7Fu : r;
  r = a > 0x7F800000u ? 0x7FC0u : r;
  return static_cast<uint16_t>(((x >> 16) & 0x8000u) | r);
}

// Stochastic rounding of v to IEEE half with the random word h (same NOTE).
GACT_HD uint16_t float_to_half_stochastic(float v, uint32_t h) {
  const uint32_t x = f_bits(v);
  const uint32_t a = x & 0x7FFFFFFFu;
  const bool subnormal = a < (113u << 23);  // |v| < 2^-14
  // Normal half: drop 13 mantissa bits after rebiasing the exponent (unsigned wrap-around for
  // subnormal inputs is harmless: that lane is not selected).
  uint32_t nrm = (a - (112u << 23) + (h >> 19)) >> 13;
  nrm = nrm > 0x7BFFu ? 0x7BFFu : nrm;
  // Subnormal half: multiples of 2^-24. With |v| = mant * 2^-(126 + s) (s >= 14 when |v| <
  // 2^-14), t = |v| * 2^24 = mant / 2^s, so k = mant >> s and trunc((t - k) * 2^32) is the low
  // word of (mant << 32) >> s: mant << (32 - s) for s <= 32, mant >> (s - 32) above (mant <
  // 2^24, so shifts by 31 or more give 0). Integer shifts of 32-bit lanes only: they vectorise
  // at full width (float -> int conversions of values the compiler cannot bound do not, and
  // 64-bit lanes halve it).
  const uint32_t exponent = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | (static_cast<uint32_t>(exponent != 0u) << 23);
  const uint32_t e = exponent > 1u ? exponent : 1u;  // fp32 subnormals share exponent 1's scale
  const uint32_t shift = 126u - (e < 112u ? e : 112u);  // 14 .. 125
  const uint32_t k = mant >> (shift < 31u ? shift : 31u);
  const uint32_t down = shift - 32u < 31u ? shift - 32u : 31u;  // wraps to >= 31 for s < 32
  const uint32_t frac32 = shift <= 32u ? mant << ((32u - shift) & 31u) : mant >> down;
  const uint32_t sub = k + (h > ~frac32 ? 1u : 0u);
  uint32_t r = subnormal ? sub : nrm;
  r = a > 0x7F800000u ? 0x7E00u : r;
  return static_cast<uint16_t>(((x >> 16) & 0x8000u) | r);
}

// ---- counter-based random stream -------------------------------------------------------------
GACT_HD uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}
// Per-call key, computed once on the host: k0 = low, k1 = high 32 bits of a 64-bit key.
struct StreamKey {
  uint32_t k0;
  uint32_t k1;
};
inline StreamKey split_key(uint64_t k) {
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}
inline StreamKey quantize_key(uint64_t seed) { return split_key(mix64(seed + kGamma)); }
inline StreamKey dequantize_key(uint64_t seed) { return split_key(mix64(mix64(seed + kGamma))); }
inline StreamKey rotation_key(uint64_t seed) {
  return split_key(mix64(mix64(mix64(seed + kGamma))));
}
// The part of the hash input that depends on the high 32 bits of the element index; constant
// over runs of 2^32 elements, so the loops hoist it.
GACT_HD uint32_t stream_high(StreamKey key, uint64_t e) {
  return static_cast<uint32_t>(e >> 32) * kHighMul + key.k1;
}
// 32 random bits for the element whose index has low 32 bits `e_low`, given as its product
// `low_mul` = e_low * kLowMul (mod 2^32): loops over consecutive elements carry that product as
// a sum (+ kLowMul per element), which vectorises without a multiply and without 64-bit index
// arithmetic. 32-bit arithmetic only (cheap in SIMD lanes and on GPUs); lowbias32 finaliser.
GACT_HD uint32_t hash32_of_product(StreamKey key, uint32_t high, uint32_t low_mul) {
  uint32_t h = (low_mul ^ high) + key.k0;
  h ^= h >> 16;
  h *= kFin1;
  h ^= h >> 15;
  h *= kFin2;
  h ^= h >> 16;
  return h;
}
GACT_HD uint32_t hash32(StreamKey key, uint32_t high, uint32_t e_low) {
  return hash32_of_product(key, high, e_low * kLowMul);
}
// u in [0, 1) with 24 random bits, from hash32_of_product.
GACT_HD float uniform24_of_product(StreamKey key, uint32_t high, uint32_t low_mul) {
  const uint32_t h = hash32_of_product(key, high, low_mul);
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * 5.9604644775390625e-08f /* 2^-24 */;
}
GACT_HD float uniform24(StreamKey key, uint32_t high, uint32_t e_low) {
  return uniform24_of_product(key, high, e_low * kLowMul);
}

// ---- quantisation ------------------------------------------------------------------------------
// The first positive level of the zero-exact grid: the smallest positive normal number of the
// input dtype (NOTE [storage and RNG invariants], "Zero-exact grid").
template <int DT>
GACT_HD constexpr float zero_exact_tiny() {
  return DT == kFloat16 ? 6.103515625e-05f /* 2^-14 */ : kFloatMin;
}

struct GroupParams {
  float lo;
  float scale;  // NaN flags a group stored losslessly by the wrapper; 0 for constant groups
  bool zero_exact;  // coded on the zero-exact grid (then lo == +0 and scale is its step)
};

// Whether a group with stored `lo` is decoded on the zero-exact grid (mode on, lo == +0).
GACT_HD bool zero_exact_group(bool zero_exact, float lo) {
  return zero_exact && f_bits(lo) == 0u;
}

// mn/mx: min and max over the group (ignoring NaN); bad: nonzero if any element is non-finite;
// zero_exact: the mode; tiny: zero_exact_tiny<DT>().
GACT_HD GroupParams group_params(float mn, float mx, uint32_t bad, float levels, bool zero_exact,
                                 float tiny) {
  const float lo = f_add(mn, 0.0f);
  const float hi = f_add(mx, 0.0f);
  const float range = f_sub(hi, lo);
  const float scale = f_div(range, levels);
  GroupParams p;
  p.zero_exact = false;
  if (bad || is_nonfinite(range) || (range > 0.0f && scale < kFloatMin)) {
    p.lo = 0.0f;
    p.scale = f_from_bits(0x7FC00000u);
  } else if (zero_exact_group(zero_exact, lo)) {
    p.lo = lo;
    p.scale = f_div(f_max(f_sub(hi, tiny), 0.0f), f_sub(levels, 1.0f));
    p.zero_exact = true;
  } else {
    p.lo = lo;
    p.scale = scale;
  }
  return p;
}
// Code for one element of a group with finite, nonzero scale.
GACT_HD uint32_t quantize_one(float x, float lo, float scale, float levels, float u) {
  const float t = f_add(f_div(f_sub(x, lo), scale), u);
  return static_cast<uint32_t>(static_cast<int32_t>(f_min(t, levels)));
}
// Code for one element of a zero-exact group (top = 2^b - 2, step >= 0; see the NOTE).
GACT_HD uint32_t quantize_zero_exact_one(float x, float tiny, float step, float top, float u) {
  const float d = f_max(f_sub(x, tiny), 0.0f);
  const float t = f_add(f_div(d, step > 0.0f ? step : 1.0f), u);
  const uint32_t k = static_cast<uint32_t>(static_cast<int32_t>(f_min(t, top)));
  return x > 0.0f ? k + 1u : 0u;
}
// The level of code q, clamped to the finite floats (NaN, for flagged groups, passes through).
GACT_HD float dequantize_one(uint32_t q, float lo, float scale) {
  const float v = f_add(lo, f_mul(static_cast<float>(static_cast<int32_t>(q)), scale));
  return v > kFloatMax ? kFloatMax : (v < -kFloatMax ? -kFloatMax : v);
}
// The level of code q in a zero-exact group: exactly +0 for q == 0, else >= tiny.
GACT_HD float dequantize_zero_exact_one(uint32_t q, float tiny, float step) {
  float v = f_add(tiny, f_mul(static_cast<float>(static_cast<int32_t>(q) - 1), step));
  v = v > kFloatMax ? kFloatMax : v;
  // Code 0: clear every bit (+0). An integer mask, not a branch: the CPU loop vectorises.
  return f_from_bits(f_bits(v) & (0u - static_cast<uint32_t>(q != 0u)));
}

// Storage type and conversions per float dtype code, resolved at compile time. `store` gets
// the element's random word h (unused for float32, which keeps round to nearest).
template <int DT>
struct Elem {
  using type = uint16_t;
  static GACT_HD float load(uint16_t v) { return DT == kFloat16 ? half_to_float(v) : bf16_to_float(v); }
  static GACT_HD uint16_t store(float f, uint32_t h) {
    return DT == kFloat16 ? float_to_half_stochastic(f, h) : float_to_bf16_stochastic(f, h);
  }
};
template <>
struct Elem<kFloat32> {
  using type = float;
  static GACT_HD float load(float v) { return v; }
  static GACT_HD float store(float f, uint32_t) { return f; }
};

// ---- integer packing ---------------------------------------------------------------------------
template <int DT>
struct IntElem;
template <>
struct IntElem<kUInt8> {
  using type = uint8_t;
};
template <>
struct IntElem<kInt8> {
  using type = int8_t;
};
template <>
struct IntElem<kInt16> {
  using type = int16_t;
};
template <>
struct IntElem<kInt32> {
  using type = int32_t;
};
template <>
struct IntElem<kInt64> {
  using type = int64_t;
};

// Number of bits needed for d (0 for d == 0).
GACT_HD int bit_width(uint64_t d) {
#if defined(__CUDA_ARCH__)
  return 64 - __clzll(static_cast<long long>(d));
#else
  return d == 0 ? 0 : 64 - __builtin_clzll(d);
#endif
}
GACT_HD uint64_t low_bits(int w) { return w >= 64 ? ~uint64_t{0} : (uint64_t{1} << w) - 1; }
GACT_HD int64_t packed_bytes(int64_t m, int w) { return (m * w + 7) / 8; }

// Little-endian bit stream writer: put(v, w) appends the w low bits of v (v < 2^w, 1 <= w <= 64);
// finish() writes the last, partial word. Whole words go out as 8 bytes at a time.
struct BitWriter {
  uint8_t* p;
  uint64_t acc = 0;
  int nb = 0;  // bits held in acc, always < 64

  GACT_HD explicit BitWriter(uint8_t* dst) : p(dst) {}
  GACT_HD void store(uint64_t v, int bytes) {
    for (int k = 0; k < bytes; ++k) p[k] = static_cast<uint8_t>(v >> (8 * k));
    p += bytes;
  }
  GACT_HD void put(uint64_t v, int w) {
    acc |= v << nb;
    if (nb + w >= 64) {
      store(acc, 8);
      acc = nb > 0 ? v >> (64 - nb) : 0;
      nb += w - 64;
    } else {
      nb += w;
    }
  }
  GACT_HD void finish() { store(acc, (nb + 7) / 8); }
};

// Reader for the stream above, over exactly `bytes` bytes (never reads past them).
struct BitReader {
  const uint8_t* p;
  int64_t left;  // bytes not yet loaded
  uint64_t acc = 0;
  int nb = 0;  // bits held in acc

  GACT_HD BitReader(const uint8_t* src, int64_t bytes) : p(src), left(bytes) {}
  GACT_HD uint64_t take(int w) {  // 1 <= w <= 64
    if (nb >= w) {
      const uint64_t v = acc & low_bits(w);
      acc = w < 64 ? acc >> w : 0;
      nb -= w;
      return v;
    }
    const int k = left < 8 ? static_cast<int>(left) : 8;
    uint64_t next = 0;
    for (int i = 0; i < k; ++i) next |= static_cast<uint64_t>(p[i]) << (8 * i);
    p += k;
    left -= k;
    const int used = w - nb;  // 1..64 bits of `next`
    const uint64_t v = (acc | (next << nb)) & low_bits(w);
    acc = used < 64 ? next >> used : 0;
    nb = 8 * k - used;
    return v;
  }
};

inline void check_group_size(int64_t G) {
  if (G <= 0 || G % kChunk != 0) throw std::invalid_argument("group_size must be a multiple of 8");
}
inline void check_zero_exact(bool zero_exact, int bits) {
  if (zero_exact && bits < 2) {
    throw std::invalid_argument("zero_exact needs bits >= 2 (1 bit leaves one positive level)");
  }
}

// ---- rotation ----------------------------------------------------------------------------------
constexpr uint64_t kSignSeed = 0x6AC7;
constexpr int64_t kMaxRotationBlock = 4096;
// Whether position i of a rotation block has sign -1 (`signs` = quantize_key(kSignSeed)).
GACT_HD bool rotation_negates(StreamKey signs, uint32_t i) {
  return (hash32(signs, signs.k1, i) >> 31) != 0u;
}
inline void check_rotation_block(int64_t block) {
  if (block < 2 || block > kMaxRotationBlock || (block & (block - 1)) != 0) {
    throw std::invalid_argument("rotation block must be a power of two in [2, 4096]");
  }
}

// Host-side dispatch: calls F<DT, B>::run(args...) for a runtime dtype code and bit width.
template <template <int, int> class F, int DT, typename... A>
void with_bits(int bits, A... args) {
  switch (bits) {
    case 1: return F<DT, 1>::run(args...);
    case 2: return F<DT, 2>::run(args...);
    case 3: return F<DT, 3>::run(args...);
    case 4: return F<DT, 4>::run(args...);
    case 5: return F<DT, 5>::run(args...);
    case 6: return F<DT, 6>::run(args...);
    case 7: return F<DT, 7>::run(args...);
    case 8: return F<DT, 8>::run(args...);
    default: throw std::invalid_argument("bits must be in 1..8");
  }
}
template <template <int, int> class F, typename... A>
void dispatch(int dtype, int bits, A... args) {
  switch (dtype) {
    case kFloat32: return with_bits<F, kFloat32>(bits, args...);
    case kFloat16: return with_bits<F, kFloat16>(bits, args...);
    case kBFloat16: return with_bits<F, kBFloat16>(bits, args...);
    default: throw std::invalid_argument("dtype code must be 0 (fp32), 1 (fp16) or 2 (bf16)");
  }
}
// Calls F<DT>::run(args...) for a runtime float dtype code.
template <template <int> class F, typename... A>
void dispatch_float(int dtype, A... args) {
  switch (dtype) {
    case kFloat32: return F<kFloat32>::run(args...);
    case kFloat16: return F<kFloat16>::run(args...);
    case kBFloat16: return F<kBFloat16>::run(args...);
    default: throw std::invalid_argument("dtype code must be 0 (fp32), 1 (fp16) or 2 (bf16)");
  }
}
// Calls F<DT>::run(args...) for a runtime integer dtype code.
template <template <int> class F, typename... A>
void dispatch_int(int dtype, A... args) {
  switch (dtype) {
    case kUInt8: return F<kUInt8>::run(args...);
    case kInt8: return F<kInt8>::run(args...);
    case kInt16: return F<kInt16>::run(args...);
    case kInt32: return F<kInt32>::run(args...);
    case kInt64: return F<kInt64>::run(args...);
    default: throw std::invalid_argument("dtype code must be an integer code (3..7)");
  }
}

}  // namespace gact
