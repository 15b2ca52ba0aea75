// Packing b-bit codes (one per byte) into the bitstream of NOTE [storage and RNG invariants]
// (common.h) and back, on the CPU: a portable path that gcc vectorises, and a byte-permute path
// for CPUs with AVX-512 VBMI. Both write and read the same bytes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "cpu_threads.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GACT_HAVE_VBMI 1
#define GACT_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))
#else
#define GACT_HAVE_VBMI 0
#endif

namespace gact {
namespace {  // included by cpu.cpp only

// NOTE [odd widths]
// A chunk of 8 codes of B bits is B bytes: the 8 codes, one per byte of a uint64 in memory, low
// B bits kept, become the low 8B bits of the packed word. Instead of moving the codes one at a
// time (8 shifts, masks and ors per chunk each way) a word is compacted in three steps, each
// merging neighbouring fields into one of twice the width: bytes into 16-bit lanes (2B bits),
// those into 32-bit lanes (4B bits), those into the word (8B bits); unpacking runs the steps
// backwards.
// * Portable path: per group the words go through a buffer, computed by loops gcc vectorises
//   (the chunks are independent), and are stored or loaded at B-byte offsets by a plain loop.
//   Packing takes it at 3, 5, 6 and 7 bits (1, 2 and 4 pack whole codes per byte), unpacking
//   at every width but 4 and 8.
// * VBMI path (every width but 4 and 8, on CPUs with AVX-512 VBMI): 64 codes (8 chunks) per
//   512-bit register. Packing compacts the 8 words in the register (compact_chunk on a vector
//   of words), then one byte permutation (vpermb) gathers the low B bytes of each into 8B
//   consecutive bytes. Unpacking permutes
//   chunk c's B bytes into word c, then one multishift (vpmultishiftqb) takes the 8 bits at
//   offset j*B of word c into byte j, of which the low B bits are kept. Loads and stores are
//   whole 64 bytes where those bytes are the group's to write (the packed bytes past 8B are
//   rewritten by the next iteration) or exist to be read (the packed buffer runs on past the
//   group); only the last ones are byte-masked, so that no store touches a neighbouring
//   group's bytes, which another thread may be writing. Masked stores throughout cost more than
//   they saved on the AMD EPYC VM: a 7-bit dequantize took 1.4x the portable path's.
// The reference tests compare every width byte for byte on both paths (use_vbmi switches).

// Compacts `x` in place. `W`: one word (uint64_t), or a vector of them (the VBMI path compacts 8
// words at once). By reference: a 512-bit vector passed or returned by value has another ABI
// in each SIMD clone, which gcc warns about.
template <int B, typename W>
GACT_HD void compact_chunk(W& x) {
  constexpr uint64_t kBytes = 0x00FF00FF00FF00FFull, kHalves = 0x0000FFFF0000FFFFull;
  x = (x & kBytes) | ((x & ~kBytes) >> (8 - B));
  x = (x & kHalves) | ((x & ~kHalves) >> (16 - 2 * B));
  x = (x & 0xFFFFFFFFull) | ((x >> 32) << (4 * B));
}
template <int B>
GACT_HD uint64_t spread_chunk(uint64_t w) {
  constexpr uint64_t k4 = (uint64_t{1} << (4 * B)) - 1, k2 = (uint64_t{1} << (2 * B)) - 1;
  constexpr uint64_t k1 = (uint64_t{1} << B) - 1;
  uint64_t x = (w & k4) | ((w << (32 - 4 * B)) & (k4 << 32));
  constexpr uint64_t kPer32 = 0x0000000100000001ull, kPer16 = 0x0001000100010001ull;
  x = (x & (k2 * kPer32)) | ((x << (16 - 2 * B)) & ((k2 << 16) * kPer32));
  return (x & (k1 * kPer16)) | ((x << (8 - B)) & ((k1 << 8) * kPer16));
}

// Packed words of `chunks` chunks of codes (q: 8 * chunks bytes).
template <int B>
GACT_SIMD void compact_chunks(const uint8_t* __restrict q, int64_t chunks,
                              uint64_t* __restrict words) {
  for (int64_t c = 0; c < chunks; ++c) {
    uint64_t codes;
    std::memcpy(&codes, q + c * kChunk, kChunk);
    compact_chunk<B>(codes);
    words[c] = codes;
  }
}
// Codes of `chunks` packed words, one byte each (q: 8 * chunks bytes).
template <int B>
GACT_SIMD void spread_chunks(const uint64_t* __restrict words, int64_t chunks,
                             uint8_t* __restrict q) {
  for (int64_t c = 0; c < chunks; ++c) {
    const uint64_t codes = spread_chunk<B>(words[c]);
    std::memcpy(q + c * kChunk, &codes, kChunk);
  }
}

// Packs m codes (q readable and zero up to the next multiple of 8) into ceil(m*B/8) bytes;
// `words`: room for ceil(m/8) words (3, 5, 6 and 7 bits only).
template <int B>
GACT_SIMD void pack_codes(const uint8_t* __restrict q, int64_t m, uint8_t* __restrict dst,
                          uint64_t* __restrict words) {
  if constexpr (8 % B == 0) {  // B in {1, 2, 4}: whole codes per byte
    constexpr int per = 8 / B;
    const int64_t bytes = (m + per - 1) / per;
    for (int64_t i = 0; i < bytes; ++i) {
      uint32_t byte = 0;
      for (int k = 0; k < per; ++k) byte |= static_cast<uint32_t>(q[i * per + k]) << (k * B);
      dst[i] = static_cast<uint8_t>(byte);
    }
  } else {  // B in {3, 5, 6, 7}: NOTE [odd widths]
    const int64_t chunks = (m + kChunk - 1) / kChunk;
    compact_chunks<B>(q, chunks, words);
    // A chunk is stored with one 8-byte write while the write ends inside this group's bytes
    // (its top 8 - B bytes are zeros that the next chunk overwrites); the last ones with B.
    const int64_t bytes = (m * B + 7) / 8;
    const int64_t wide = bytes < 8 ? 0 : (bytes - 8) / B + 1;
    int64_t c = 0;
    for (; c < wide; ++c) std::memcpy(dst + c * B, words + c, 8);
    for (; c + 1 < chunks; ++c) std::memcpy(dst + c * B, words + c, B);
    if (c < chunks) std::memcpy(dst + c * B, words + c, bytes - c * B);
  }
}

// Unpacks ceil(m/8)*8 codes (q must have room for them); `words`: room for ceil(m/8) words
// (every width but 4 and 8).
template <int B>
GACT_SIMD void unpack_codes(const uint8_t* __restrict src, int64_t m, uint8_t* __restrict q,
                            uint64_t* __restrict words) {
  if constexpr (B == 4) {  // one byte -> two codes vectorises best
    const int64_t bytes = (m + 1) / 2;
    for (int64_t i = 0; i < bytes; ++i) {
      q[2 * i] = src[i] & 0xF;
      q[2 * i + 1] = src[i] >> 4;
    }
  } else {  // B bytes -> 8 codes (one uint64): NOTE [odd widths]
    const int64_t chunks = (m + kChunk - 1) / kChunk;
    // One 8-byte read per chunk while it ends inside this group's bytes, fewer after.
    const int64_t bytes = (m * B + 7) / 8;
    const int64_t wide = bytes < 8 ? 0 : std::min(chunks, (bytes - 8) / B + 1);
    for (int64_t c = 0; c < wide; ++c) std::memcpy(words + c, src + c * B, 8);
    for (int64_t c = wide; c < chunks; ++c) {
      words[c] = 0;
      std::memcpy(words + c, src + c * B, std::min<int64_t>(B, bytes - c * B));
    }
    spread_chunks<B>(words, chunks, q);
  }
}

#if GACT_HAVE_VBMI
// gcc 12 warns that the intrinsics' undefined-register idiom (`__m512i __Y = __Y`) may be used
// uninitialised (gcc bug 105593); it is not.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// Whether this CPU runs the VBMI path, and whether the kernels take it (tests switch it off to
// check the portable path on the same machine).
inline bool vbmi_supported() {
  static const bool supported =
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
  return supported;
}
inline std::atomic<bool>& vbmi_flag() {
  static std::atomic<bool> on{vbmi_supported()};
  return on;
}

// Byte j of every 64-bit lane: Index<B>::pack[8c + j] = the byte of the register (8 words) that
// becomes packed byte 8c + j (word k / B, byte k % B, for k = 8c + j < 8B); ::unpack[8c + j] =
// the packed byte c * B + j that lands in byte j of word c; ::shift[8c + j] = j * B.
template <int B>
struct Index {
  alignas(64) uint8_t pack[64] = {};
  alignas(64) uint8_t unpack[64] = {};
  alignas(64) uint8_t shift[64] = {};
  constexpr Index() {
    for (int k = 0; k < 64; ++k) {
      pack[k] = static_cast<uint8_t>(k < 8 * B ? k / B * 8 + k % B : 0);
      unpack[k] = static_cast<uint8_t>(k / 8 * B + k % 8);
      shift[k] = static_cast<uint8_t>(k % 8 * B);
    }
  }
};
template <int B>
constexpr Index<B> kIndex{};

// Eight packed words in one register, as GCC's vector extension (unsigned lanes: logical shifts).
typedef uint64_t Words __attribute__((vector_size(64)));

// The low `n` bits set (n <= 64).
inline __mmask64 first_bytes(int64_t n) { return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1; }

template <int B>
GACT_VBMI void pack_codes_vbmi(const uint8_t* __restrict q, int64_t m, uint8_t* __restrict dst) {
  const int64_t bytes = (m * B + 7) / 8, codes = (m + kChunk - 1) / kChunk * kChunk;
  const __m512i perm = _mm512_load_si512(kIndex<B>.pack);
  for (int64_t i = 0, o = 0; o < bytes; i += 64, o += 8 * B) {
    __m512i x = i + 64 <= codes ? _mm512_loadu_si512(q + i)
                                : _mm512_maskz_loadu_epi8(first_bytes(codes - i), q + i);
    Words words = (Words)x;
    compact_chunk<B>(words);
    x = _mm512_permutexvar_epi8(perm, (__m512i)words);
    if (o + 64 <= bytes) {  // the bytes past 8B belong to the next iterations, which rewrite them
      _mm512_storeu_si512(dst + o, x);
    } else {
      _mm512_mask_storeu_epi8(dst + o, first_bytes(std::min<int64_t>(8 * B, bytes - o)), x);
    }
  }
}

template <int B>
GACT_VBMI void unpack_codes_vbmi(const uint8_t* __restrict src, int64_t m, int64_t readable,
                                 uint8_t* __restrict q) {
  const int64_t bytes = (m * B + 7) / 8, codes = (m + kChunk - 1) / kChunk * kChunk;
  const __m512i perm = _mm512_load_si512(kIndex<B>.unpack);
  const __m512i shift = _mm512_load_si512(kIndex<B>.shift);
  const __m512i low = _mm512_set1_epi8(static_cast<char>((1 << B) - 1));
  for (int64_t i = 0, o = 0; i < codes; i += 64, o += 8 * B) {
    // Bytes past this group's are read only where they exist (and are then not used).
    __m512i x = o + 64 <= readable ? _mm512_loadu_si512(src + o)
                                   : _mm512_maskz_loadu_epi8(first_bytes(bytes - o), src + o);
    x = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(perm, x)), low);
    if (i + 64 <= codes) {
      _mm512_storeu_si512(q + i, x);
    } else {
      _mm512_mask_storeu_epi8(q + i, first_bytes(codes - i), x);
    }
  }
}
#pragma GCC diagnostic pop
#endif  // GACT_HAVE_VBMI

// Whether the packing below takes the VBMI path (read once per kernel call).
inline bool vbmi_enabled() {
#if GACT_HAVE_VBMI
  return vbmi_flag().load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// pack_codes / unpack_codes on the path `vbmi` names (NOTE [odd widths]).
template <int B>
inline void pack_group(bool vbmi, const uint8_t* q, int64_t m, uint8_t* dst, uint64_t* words) {
#if GACT_HAVE_VBMI
  if constexpr (B != 4 && B != 8) {
    if (vbmi) return pack_codes_vbmi<B>(q, m, dst);
  }
#endif
  (void)vbmi;
  pack_codes<B>(q, m, dst, words);
}
// `readable`: the bytes from `src` on that may be read (this group's and the ones after it).
template <int B>
inline void unpack_group(bool vbmi, const uint8_t* src, int64_t m, int64_t readable, uint8_t* q,
                         uint64_t* words) {
#if GACT_HAVE_VBMI
  if constexpr (B != 4 && B != 8) {
    if (vbmi) return unpack_codes_vbmi<B>(src, m, readable, q);
  }
#endif
  (void)vbmi;
  (void)readable;
  unpack_codes<B>(src, m, q, words);
}

}  // namespace
}  // namespace gact
