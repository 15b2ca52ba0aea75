// Shared math for the CPU and CUDA kernels of gact-kernels.
//
// NOTE [storage and RNG invariants]
// Everything that decides a stored byte lives in this header, compiled by gcc for the CPU module
// and by nvcc for the CUDA module, so the two cannot drift:
//  * Groups: element e of the flattened tensor belongs to group e / G (G = group size, a multiple
//    of 8). Per group the kernels store float32 `lo` and float32 `scale`.
//  * Packing: element e is stored in bits [e*b, (e+1)*b) of one little-endian bitstream of
//    ceil(n*b/8) bytes. As G*b is a multiple of 8 every group starts on a byte boundary, and
//    8 consecutive elements (a "chunk") always fill exactly b bytes.
//  * Quantisation, all in IEEE fp32 with round-to-nearest and no contraction (host:
//    -ffp-contract=off; device: __f*_rn intrinsics):
//      lo = min(x) + 0, hi = max(x) + 0 (the "+ 0" maps -0 to +0), scale = (hi - lo) / (2^b - 1),
//      q = trunc(min((x - lo) / scale + u, 2^b - 1)), x_hat = lo + q * scale.
//    (x - lo) / scale + u >= 0, so truncation equals floor. scale == 0 stores q = 0.
//  * A group holding NaN/Inf, or whose range hi - lo overflows, is "flagged": lo = 0,
//    scale = NaN, q = 0. The Python wrapper stores such groups losslessly.
//  * RNG: u for element e is a pure function of (seed, e). Per call k = mix64(seed + GAMMA)
//    (splitmix64 finaliser), k0/k1 = its low/high 32 bits. Per element, in uint32 arithmetic:
//      h = ((lo32(e) * 0x9E3779B1) ^ (hi32(e) * 0x85EBCA77 + k1)) + k0, then the lowbias32
//      finaliser (h ^= h>>16; h *= 0x7FEB352D; h ^= h>>15; h *= 0x846CA68B; h ^= h>>16),
//      u = (h >> 8) * 2^-24 (24 random bits, exact in fp32).
//    The result does not depend on threads, blocks, streams or devices.
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

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

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

// ---- dtype conversions (exact; float -> half/bfloat16 round to nearest even) -----------------
GACT_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  // Shift exponent+mantissa into place and rebias by multiplying with 2^(127-15): exact for
  // normal and subnormal halves. Inf/NaN (exponent all ones) get the float exponent forced.
  uint32_t r = f_bits(f_mul(f_from_bits(em << 13), 5.192296858534828e+33f /* 2^112 */));
  r = em >= 0x7C00u ? (r | 0x7F800000u) : r;
  return f_from_bits(r | sign);
}
GACT_HD uint16_t float_to_half(float f) {
  const uint32_t x = f_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7FFFFFFFu;
  // Subnormal result: adding 0.5 (bits 126<<23) lets the FPU round the mantissa for us.
  const uint32_t sub = f_bits(f_add(f_from_bits(a), 0.5f)) - (126u << 23);
  // Normal result: rebias, round to nearest even on bit 13.
  const uint32_t nrm = (a + (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  uint32_t o = a < (113u << 23) ? sub : nrm;
  o = a >= (143u << 23) ? 0x7C00u : o;  // overflow to Inf (143 = 127 + 16)
  o = a > 0x7F800000u ? 0x7E00u : o;     // NaN
  return static_cast<uint16_t>(o | sign);
}
GACT_HD float bf16_to_float(uint16_t h) { return f_from_bits(static_cast<uint32_t>(h) << 16); }
GACT_HD uint16_t float_to_bf16(float f) {
  const uint32_t x = f_bits(f);
  const uint32_t r = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((x & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}

// ---- counter-based random stream -------------------------------------------------------------
GACT_HD uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}
// Per-call key, computed once on the host: k0 = low, k1 = high 32 bits of mix64(seed + GAMMA).
struct StreamKey {
  uint32_t k0;
  uint32_t k1;
};
inline StreamKey stream_key(uint64_t seed) {
  const uint64_t k = mix64(seed + kGamma);
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}
// The part of the hash input that depends on the high 32 bits of the element index; constant
// over runs of 2^32 elements, so the CPU loop hoists it.
GACT_HD uint32_t stream_high(StreamKey key, uint64_t e) {
  return static_cast<uint32_t>(e >> 32) * kHighMul + key.k1;
}
// u in [0, 1) with 24 random bits for the element whose index has low 32 bits `e_low`.
// 32-bit arithmetic only (cheap in SIMD lanes and on GPUs); lowbias32 finaliser.
GACT_HD float uniform24(StreamKey key, uint32_t high, uint32_t e_low) {
  uint32_t h = ((e_low * kLowMul) ^ high) + key.k0;
  h ^= h >> 16;
  h *= kFin1;
  h ^= h >> 15;
  h *= kFin2;
  h ^= h >> 16;
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * 5.9604644775390625e-08f /* 2^-24 */;
}

// ---- quantisation ------------------------------------------------------------------------------
struct GroupParams {
  float lo;
  float scale;  // NaN flags a group stored losslessly by the wrapper; 0 for constant groups
};

// mn/mx: min and max over the group (ignoring NaN); bad: nonzero if any element is non-finite.
GACT_HD GroupParams group_params(float mn, float mx, uint32_t bad, float levels) {
  const float lo = f_add(mn, 0.0f);
  const float range = f_sub(f_add(mx, 0.0f), lo);
  GroupParams p;
  if (bad || is_nonfinite(range)) {
    p.lo = 0.0f;
    p.scale = f_from_bits(0x7FC00000u);
  } else {
    p.lo = lo;
    p.scale = f_div(range, levels);
  }
  return p;
}
// Code for one element of a group with finite, nonzero scale.
GACT_HD uint32_t quantize_one(float x, float lo, float scale, float levels, float u) {
  const float t = f_add(f_div(f_sub(x, lo), scale), u);
  return static_cast<uint32_t>(static_cast<int32_t>(f_min(t, levels)));
}
GACT_HD float dequantize_one(uint32_t q, float lo, float scale) {
  return f_add(lo, f_mul(static_cast<float>(static_cast<int32_t>(q)), scale));
}

// Storage type and conversions per dtype code, resolved at compile time.
template <int DT>
struct Elem {
  using type = uint16_t;
  static GACT_HD float load(uint16_t v) { return DT == kFloat16 ? half_to_float(v) : bf16_to_float(v); }
  static GACT_HD uint16_t store(float f) { return DT == kFloat16 ? float_to_half(f) : float_to_bf16(f); }
};
template <>
struct Elem<kFloat32> {
  using type = float;
  static GACT_HD float load(float v) { return v; }
  static GACT_HD float store(float f) { return f; }
};

inline void check_group_size(int64_t G) {
  if (G <= 0 || G % kChunk != 0) throw std::invalid_argument("group_size must be a multiple of 8");
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

}  // namespace gact
