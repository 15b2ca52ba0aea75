// CPU kernels: OpenMP over groups (or mask bytes); inner loops are branch-free and written so
// that gcc vectorises them. See NOTE [storage and RNG invariants] in common.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu_pack.h"
#include "cpu_threads.h"
#include "kernels.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "gact-kernels assumes little endian");

namespace gact {
namespace {

template <int DT>
GACT_SIMD void to_floats(const typename Elem<DT>::type* __restrict x, int64_t m,
                         float* __restrict buf) {
  for (int64_t j = 0; j < m; ++j) buf[j] = Elem<DT>::load(x[j]);
}

// Min and max via integer keys (a signed-int order equal to the float order for non-NaN
// values), which vectorise without fast-math; NaN/Inf only set `bad`, as on the device.
inline int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }

GACT_SIMD GroupParams params_of(const float* __restrict xs, int64_t m, float levels,
                                bool zero_exact, float tiny) {
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  uint32_t bad = 0;
  for (int64_t j = 0; j < m; ++j) {
    int32_t bits;
    std::memcpy(&bits, xs + j, 4);
    const int32_t key = order_key(bits);
    lo = key < lo ? key : lo;
    hi = key > hi ? key : hi;
    bad |= is_nonfinite(xs[j]);
  }
  return group_params(f_from_bits(order_key(lo)), f_from_bits(order_key(hi)), bad, levels,
                      zero_exact, tiny);
}

// Codes of m elements whose indices have constant high 32 bits.
GACT_SIMD void codes_run(const float* __restrict xs, int64_t m, GroupParams p, float levels,
                         StreamKey key, uint32_t high, uint32_t e_low, uint8_t* __restrict q) {
  uint32_t low = e_low * kLowMul;  // the element's hash input, carried as a sum
  for (int64_t j = 0; j < m; ++j, low += kLowMul) {
    q[j] = static_cast<uint8_t>(
        quantize_one(xs[j], p.lo, p.scale, levels, uniform24_of_product(key, high, low)));
  }
}
// Same on the zero-exact grid (p.zero_exact; `levels` is still 2^b - 1).
GACT_SIMD void codes_run_zero_exact(const float* __restrict xs, int64_t m, GroupParams p,
                                    float levels, float tiny, StreamKey key, uint32_t high,
                                    uint32_t e_low, uint8_t* __restrict q) {
  const float top = f_sub(levels, 1.0f);
  uint32_t low = e_low * kLowMul;  // as in codes_run
  for (int64_t j = 0; j < m; ++j, low += kLowMul) {
    q[j] = static_cast<uint8_t>(
        quantize_zero_exact_one(xs[j], tiny, p.scale, top, uniform24_of_product(key, high, low)));
  }
}

// Calls body(j, len, high, e_low) over runs [j, j + len) of the m elements starting at index
// `first` whose indices share their high 32 bits (one run unless a multiple of 2^32 is crossed).
template <typename Body>
void by_runs(StreamKey key, uint64_t first, int64_t m, Body body) {
  for (int64_t j = 0; j < m;) {
    const uint64_t e = first + j;
    const int64_t len = std::min<int64_t>(m - j, (int64_t{1} << 32) - (e & 0xFFFFFFFFu));
    body(j, len, stream_high(key, e), static_cast<uint32_t>(e));
    j += len;
  }
}

void codes_of(const float* xs, int64_t m, GroupParams p, float levels, float tiny,
              StreamKey key, uint64_t first, uint8_t* q) {
  by_runs(key, first, m, [&](int64_t j, int64_t len, uint32_t high, uint32_t e_low) {
    if (p.zero_exact) {
      codes_run_zero_exact(xs + j, len, p, levels, tiny, key, high, e_low, q + j);
    } else {
      codes_run(xs + j, len, p, levels, key, high, e_low, q + j);
    }
  });
}

GACT_SIMD void dequantize_run(const uint8_t* __restrict q, int64_t m, float lo, float scale,
                              float* __restrict out) {
  for (int64_t j = 0; j < m; ++j) out[j] = dequantize_one(q[j], lo, scale);
}
GACT_SIMD void dequantize_run_zero_exact(const uint8_t* __restrict q, int64_t m, float tiny,
                                         float step, float* __restrict out) {
  for (int64_t j = 0; j < m; ++j) out[j] = dequantize_zero_exact_one(q[j], tiny, step);
}
// The levels of one group's m codes, on the grid the mode and its lo select.
inline void levels_of(const uint8_t* q, int64_t m, float lo, float scale, bool zero_exact,
                      float tiny, float* out) {
  if (zero_exact_group(zero_exact, lo)) {
    dequantize_run_zero_exact(q, m, tiny, scale, out);
  } else {
    dequantize_run(q, m, lo, scale, out);
  }
}

// Rounds m levels stochastically to DT (fp16/bf16) with the dequantisation stream.
template <int DT>
GACT_SIMD void round_run(const float* __restrict v, int64_t m, StreamKey key, uint32_t high,
                         uint32_t e_low, uint16_t* __restrict out) {
  uint32_t low = e_low * kLowMul;  // as in codes_run
  for (int64_t j = 0; j < m; ++j, low += kLowMul) {
    out[j] = Elem<DT>::store(v[j], hash32_of_product(key, high, low));
  }
}

// The channel-major block of NOTE [channel groups] (_layout.py) read from, and written to, its
// tensor in place: the tensor is [outer][channels][inner] in memory; channel c's run is its
// outer * inner elements in (outer, inner) order, padded to `run` elements (a multiple of the
// group size) by repeating its last element. `run == 0`: the block is the memory itself.
struct Runs {
  int64_t outer = 0, channels = 0, inner = 0, run = 0;
};

// NOTE [group order]
// The kernels' loops may visit the groups in any order: each group's bytes depend only on its
// index. Over channel runs read in place, the order follows the input's memory:
// * Pieces of fewer than kStreamInner elements (channels-last: one element; small maps): every
//   channel's b-th group before any channel's (b+1)-th. For a channels-last tensor a group is
//   256 positions of one channel, `channels` elements apart, so in channel order each group's
//   reads touched a cache line per element and the next channel's group re-read the same lines
//   after the whole tensor had passed through the cache (the tensor was read once per channel);
//   in this order the channels of one block of positions follow each other while its lines
//   are cached.
// * Longer pieces (NCHW maps of 12x12 and more): channel by channel, as the groups are
//   numbered. A piece is then read as a stream of cache lines either way, and block by block
//   the loop read (and wrote the packed groups of) every channel at once, 32 to 512 interleaved
//   streams that the prefetcher could not follow: a 128x32x28x28 tensor quantized in 4.1 ms in
//   that order against 3.0 ms in this one, and dequantized in 3.2 against 2.3 ms (one thread).
constexpr int64_t kStreamInner = 128;
inline int64_t group_at(int64_t t, const Runs& r, int64_t G) {
  if (r.run == 0 || r.inner >= kStreamInner) return t;
  const int64_t blocks = r.run / G;  // groups per channel (a run is whole groups)
  return t % r.channels * blocks + t / r.channels;
}

// Elements [first, first + m) of the block (within one channel's run) as floats: pieces of up
// to `inner` contiguous elements, `channels * inner` apart (one element each for inner == 1,
// the channels-last and 1x1-map case).
template <int DT>
void gather_run(const typename Elem<DT>::type* x, const Runs& r, int64_t first, int64_t m,
                float* buf) {
  const int64_t c = first / r.run, j = first % r.run, stride = r.channels * r.inner;
  int64_t o = j / r.inner, i = j % r.inner, k = 0;
  if (r.inner == 1) {
    for (const auto* src = x + o * stride + c; k < m && o < r.outer; ++k, ++o, src += stride) {
      buf[k] = Elem<DT>::load(*src);
    }
  } else {
    for (; k < m && o < r.outer; ++o, i = 0) {
      const int64_t take = std::min(r.inner - i, m - k);
      const auto* src = x + o * stride + c * r.inner + i;
      for (int64_t t = 0; t < take; ++t) buf[k + t] = Elem<DT>::load(src[t]);
      k += take;
    }
  }
  if (k < m) {  // padding: the run's last element
    const float last = Elem<DT>::load(x[(r.outer - 1) * stride + c * r.inner + r.inner - 1]);
    std::fill(buf + k, buf + m, last);
  }
}

// NOTE [channel tiles]
// A channels-last run (inner == 1) is read and written one element per cache line: its
// channel's elements are `channels` apart. When the channels come in eights (and so, by NOTE
// [group order], eight consecutive loop steps are the same block of eight channels, and they
// fall in one task of kGroupsPerTask steps), the first of them handles all eight groups at
// once through a tile of eight rows of G values: the quantization gathers eight channels per
// position with one contiguous read, the dequantization writes them back with one contiguous
// write, and 8 x 8 squares of them are transposed in registers (Square8) on the way. Element
// by element, a scalar store per value had bounded both loops: a 64x256x8x8 channels-last
// tensor dequantized in 1.8 ms that way, in 0.5 ms with tiles (one thread).
constexpr int64_t kTileChannels = 8;
static_assert(kGroupsPerTask % kTileChannels == 0, "a tile's steps must fall in one task");
// Whether the loops over `r` go through tiles: channels-last runs of channels in eights.
inline bool tiled_runs(const Runs& r) {
  return r.run != 0 && r.inner == 1 && r.channels % kTileChannels == 0;
}

// Eight rows of eight T, transposed in registers by three rounds of two-row shuffles: the
// round of distance S swaps the off-diagonal S x S blocks of every 2S x 2S block. (gcc and
// clang spell a two-vector shuffle differently; no other compiler builds these kernels.)
template <typename T>
struct Square8 {
  typedef T Row __attribute__((vector_size(8 * sizeof(T))));
  Row rows[8];

  // out = lanes `Lane` of a ++ b (lanes 8..15 are b's); no vector crosses a call.
  template <int... Lane>
  static GACT_HD void shuffle(const Row& a, const Row& b, Row& out) {
#if defined(__clang__)
    out = __builtin_shufflevector(a, b, Lane...);
#else
    using Index = std::conditional_t<sizeof(T) == 4, int32_t, int16_t>;
    typedef Index Mask __attribute__((vector_size(8 * sizeof(T))));
    out = __builtin_shuffle(a, b, Mask{Lane...});
#endif
  }
  // New row i, lane k: k & S ? row (i + S)[k - S] : row i[k]; new row i + S: k & S ?
  // row (i + S)[k] : row i[k + S].
  template <int S, int... Low, int... High>
  GACT_HD void swap_blocks(std::integer_sequence<int, Low...>,
                           std::integer_sequence<int, High...>) {
    for (int i = 0; i < 8; ++i) {
      if (i & S) continue;
      const Row a = rows[i], b = rows[i + S];
      shuffle<Low...>(a, b, rows[i]);
      shuffle<High...>(a, b, rows[i + S]);
    }
  }
  GACT_HD void transpose() {
    using std::integer_sequence;
    swap_blocks<4>(integer_sequence<int, 0, 1, 2, 3, 8, 9, 10, 11>{},
                   integer_sequence<int, 4, 5, 6, 7, 12, 13, 14, 15>{});
    swap_blocks<2>(integer_sequence<int, 0, 1, 8, 9, 4, 5, 12, 13>{},
                   integer_sequence<int, 2, 3, 10, 11, 6, 7, 14, 15>{});
    swap_blocks<1>(integer_sequence<int, 0, 8, 2, 10, 4, 12, 6, 14>{},
                   integer_sequence<int, 1, 9, 3, 11, 5, 13, 7, 15>{});
  }
};
static_assert(kTileChannels == 8, "a tile is one Square8 wide");

// Fills `tile` (kTileChannels rows of G floats) with the group-sized pieces [j, j + G) of the
// runs of channels c .. c + 7 (inner == 1; positions past `outer` repeat the last one).
template <int DT>
GACT_SIMD void gather_tile(const typename Elem<DT>::type* __restrict x, const Runs& r, int64_t c,
                           int64_t j, int64_t G, float* __restrict tile) {
  Square8<typename Elem<DT>::type> square;
  for (int64_t k = 0; k < G; k += kTileChannels) {
    for (int i = 0; i < kTileChannels; ++i) {
      const int64_t o = std::min(j + k + i, r.outer - 1);
      std::memcpy(&square.rows[i], x + o * r.channels + c, sizeof(square.rows[i]));
    }
    square.transpose();
    for (int ch = 0; ch < kTileChannels; ++ch) {
      for (int i = 0; i < kTileChannels; ++i) {
        tile[ch * G + k + i] = Elem<DT>::load(square.rows[ch][i]);
      }
    }
  }
}

// The inverse: writes the positions [j, j + G) below `outer` of `tile` (kTileChannels rows of
// G values: channels c .. c + 7) to their places.
template <typename T>
GACT_SIMD void scatter_tile(const T* __restrict tile, const Runs& r, int64_t c, int64_t j,
                            int64_t G, T* __restrict out) {
  Square8<T> square;
  for (int64_t k = 0; k < G && j + k < r.outer; k += kTileChannels) {
    for (int ch = 0; ch < kTileChannels; ++ch) {
      std::memcpy(&square.rows[ch], tile + ch * G + k, sizeof(square.rows[ch]));
    }
    square.transpose();
    const int64_t positions = std::min(kTileChannels, r.outer - j - k);
    for (int64_t i = 0; i < positions; ++i) {
      std::memcpy(out + (j + k + i) * r.channels + c, &square.rows[i], sizeof(square.rows[i]));
    }
  }
}

// Writes elements [first, first + m) of the block back to their places (padding is dropped).
template <typename T>
void scatter_run(const T* buf, const Runs& r, int64_t first, int64_t m, T* out) {
  const int64_t c = first / r.run, j = first % r.run, stride = r.channels * r.inner;
  int64_t o = j / r.inner, i = j % r.inner, k = 0;
  if (r.inner == 1) {
    for (T* dst = out + o * stride + c; k < m && o < r.outer; ++k, ++o, dst += stride) {
      *dst = buf[k];
    }
    return;
  }
  for (; k < m && o < r.outer; ++o, i = 0) {
    const int64_t take = std::min(r.inner - i, m - k);
    T* dst = out + o * stride + c * r.inner + i;
    const T* src = buf + k;
    // fixed-size copies, inlined: a memcpy call per piece made small NCHW maps (2x2: 64 pieces
    // of 4 elements per group) dequantize 1.2x slower
    int64_t t = 0;
    for (; t + 8 <= take; t += 8) std::memcpy(dst + t, src + t, 8 * sizeof(T));
    for (; t < take; ++t) dst[t] = src[t];
    k += take;
  }
}

template <int DT, int B>
void quantize_impl(const typename Elem<DT>::type* x, int64_t n, int64_t G, StreamKey key,
                   bool zero_exact, uint8_t* out, float* lo, float* scale, int threads,
                   const Runs& runs) {
  const int64_t groups = (n + G - 1) / G;
  const float levels = static_cast<float>((1 << B) - 1);
  constexpr float tiny = zero_exact_tiny<DT>();
  const bool tiled = tiled_runs(runs);  // NOTE [channel tiles]
  const bool vbmi = vbmi_enabled();  // NOTE [odd widths]
#pragma omp parallel num_threads(team_size(threads, n))
  {
    std::vector<float> fbuf((DT == kFloat32 && runs.run == 0) || tiled ? 0 : G);
    std::vector<uint8_t> qbuf(B == 8 ? 0 : G + kChunk, 0);
    std::vector<uint64_t> words(8 % B == 0 ? 0 : G / kChunk + 1);  // NOTE [odd widths]
    std::vector<float> tile(tiled ? kTileChannels * G : 0);  // NOTE [channel tiles]
#pragma omp for schedule(dynamic, kGroupsPerTask)
    for (int64_t t = 0; t < groups; ++t) {
      const int64_t g = group_at(t, runs, G);  // NOTE [group order]
      const int64_t first = g * G;
      const int64_t m = std::min(G, n - first);
      const float* xs = fbuf.data();
      if (tiled) {
        const int64_t c = t % runs.channels, row = c % kTileChannels;
        if (row == 0) gather_tile<DT>(x, runs, c, first % runs.run, G, tile.data());
        xs = tile.data() + row * G;
      } else if (runs.run != 0) {
        gather_run<DT>(x, runs, first, m, fbuf.data());
      } else if constexpr (DT == kFloat32) {
        xs = x + first;
      } else {
        to_floats<DT>(x + first, m, fbuf.data());
      }
      const GroupParams p = params_of(xs, m, levels, zero_exact, tiny);
      lo[g] = p.lo;
      scale[g] = p.scale;
      uint8_t* dst = out + first / kChunk * B;
      // Constant (0) or flagged (NaN) group: all codes 0. A zero-exact group is coded even
      // with a step of 0 (its positives get code 1).
      if (!(p.scale > 0.0f) && !p.zero_exact) {
        std::memset(dst, 0, (m * B + 7) / 8);
        continue;
      }
      if constexpr (B == 8) {
        codes_of(xs, m, p, levels, tiny, key, first, dst);
      } else {
        codes_of(xs, m, p, levels, tiny, key, first, qbuf.data());
        std::memset(qbuf.data() + m, 0, kChunk);
        pack_group<B>(vbmi, qbuf.data(), m, dst, words.data());
      }
    }
  }
}

template <int DT, int B>
void dequantize_impl(const uint8_t* data, const float* lo, const float* scale, int64_t n,
                     int64_t G, StreamKey key, bool zero_exact, typename Elem<DT>::type* out,
                     int threads, const Runs& runs) {
  using T = typename Elem<DT>::type;
  const int64_t groups = (n + G - 1) / G;
  constexpr float tiny = zero_exact_tiny<DT>();
  const bool tiled = tiled_runs(runs);  // NOTE [channel tiles]
  const bool vbmi = vbmi_enabled();  // NOTE [odd widths]
#pragma omp parallel num_threads(team_size(threads, n))
  {
    std::vector<uint8_t> qbuf(B == 8 ? 0 : G + kChunk);
    std::vector<uint64_t> words(B == 4 || B == 8 ? 0 : G / kChunk + 1);  // NOTE [odd widths]
    std::vector<float> fbuf(DT == kFloat32 ? 0 : G);  // levels before fp16/bf16 rounding
    std::vector<T> tbuf(runs.run == 0 || tiled ? 0 : G);  // a group on its way to scatter_run
    std::vector<T> tile(tiled ? kTileChannels * G : 0);
    // Writes the values of group g's m codes to dst (rounded with the block's indices).
    const auto values = [&](int64_t g, int64_t m, T* dst) {
      const int64_t first = g * G;
      const uint8_t* q = data + first / kChunk * B;
      if constexpr (B != 8) {
        unpack_group<B>(vbmi, q, m, data + (n * B + 7) / 8 - q, qbuf.data(), words.data());
        q = qbuf.data();
      }
      if constexpr (DT == kFloat32) {
        levels_of(q, m, lo[g], scale[g], zero_exact, tiny, dst);
      } else {
        levels_of(q, m, lo[g], scale[g], zero_exact, tiny, fbuf.data());
        by_runs(key, first, m, [&](int64_t j, int64_t len, uint32_t high, uint32_t e_low) {
          round_run<DT>(fbuf.data() + j, len, key, high, e_low, dst + j);
        });
      }
    };
#pragma omp for schedule(dynamic, kGroupsPerTask)
    for (int64_t t = 0; t < groups; ++t) {
      const int64_t g = group_at(t, runs, G);  // NOTE [group order]
      const int64_t first = g * G;
      const int64_t m = std::min(G, n - first);
      if (tiled) {  // steps t .. t + 7: this block of channels c .. c + 7 (NOTE [channel tiles])
        const int64_t c = t % runs.channels;
        if (c % kTileChannels != 0) continue;
        for (int64_t row = 0; row < kTileChannels; ++row) {
          values(g + row * (runs.run / G), G, tile.data() + row * G);
        }
        scatter_tile(tile.data(), runs, c, first % runs.run, G, out);
      } else if (runs.run == 0) {
        values(g, m, out + first);
      } else {
        values(g, m, tbuf.data());
        scatter_run(tbuf.data(), runs, first, m, out);
      }
    }
  }
}

template <int DT, int B>
struct Quantize {
  static void run(const void* x, int64_t n, int64_t G, StreamKey key, bool zero_exact,
                  uint8_t* out, float* lo, float* scale, int threads, Runs runs) {
    quantize_impl<DT, B>(static_cast<const typename Elem<DT>::type*>(x), n, G, key, zero_exact,
                         out, lo, scale, threads, runs);
  }
};
template <int DT, int B>
struct Dequantize {
  static void run(const uint8_t* data, const float* lo, const float* scale, int64_t n, int64_t G,
                  StreamKey key, bool zero_exact, void* out, int threads, Runs runs) {
    dequantize_impl<DT, B>(data, lo, scale, n, G, key, zero_exact,
                           static_cast<typename Elem<DT>::type*>(out), threads, runs);
  }
};

// Bucket counts of a chunk: per bound, one vectorised pass over the chunk (in L1 cache).
GACT_SIMD void bucket_chunk(const float* __restrict xs, int64_t m, const float* __restrict bounds,
                            int nb, uint8_t* __restrict out) {
  for (int64_t j = 0; j < m; ++j) out[j] = 0;
  for (int k = 0; k < nb; ++k) {
    const float b = bounds[k];
    for (int64_t j = 0; j < m; ++j) out[j] += static_cast<uint8_t>(!(xs[j] <= b));
  }
}

template <int DT>
struct Bucketize {
  static void run(const void* x, int64_t n, const float* bounds, int nb, uint8_t* out,
                  int threads) {
    constexpr int64_t kSpan = 2048;  // elements per task, in L1 cache
    const auto* in = static_cast<const typename Elem<DT>::type*>(x);
    const int64_t spans = (n + kSpan - 1) / kSpan;
#pragma omp parallel num_threads(team_size(threads, n))
    {
      std::vector<float> buf(kSpan);
#pragma omp for schedule(dynamic, 16)
      for (int64_t c = 0; c < spans; ++c) {
        const int64_t first = c * kSpan, m = std::min(kSpan, n - first);
        to_floats<DT>(in + first, m, buf.data());
        bucket_chunk(buf.data(), m, bounds, nb, out + first);
      }
    }
  }
};

}  // namespace

namespace {
// Groups the quantize kernels flagged for lossless storage (NaN scale).
int64_t lossless_groups(const float* scale, int64_t groups) {
  return std::count_if(scale, scale + groups, [](float s) { return std::isnan(s); });
}
}  // namespace

int64_t quantize_cpu(const void* x, int dtype, int64_t n, int64_t group_size, int bits,
                     uint64_t seed, bool zero_exact, uint8_t* out, float* lo, float* scale,
                     int threads) {
  check_group_size(group_size);
  check_zero_exact(zero_exact, bits);
  if (n <= 0) return 0;
  dispatch<Quantize>(dtype, bits, x, n, group_size, quantize_key(seed), zero_exact, out, lo,
                     scale, threads, Runs{});
  return lossless_groups(scale, (n + group_size - 1) / group_size);
}

bool vbmi_supported_cpu() {
#if GACT_HAVE_VBMI
  return vbmi_supported();
#else
  return false;
#endif
}

bool use_vbmi_cpu(bool on) {
  if (on && !vbmi_supported_cpu()) {
    throw std::invalid_argument("use_vbmi: this CPU has no AVX-512 VBMI");
  }
#if GACT_HAVE_VBMI
  return vbmi_flag().exchange(on);
#else
  return false;
#endif
}

namespace {
Runs checked_runs(int64_t outer, int64_t channels, int64_t inner, int64_t run,
                  int64_t group_size) {
  if (outer < 1 || channels < 1 || inner < 1 || run < outer * inner || run % group_size != 0) {
    throw std::invalid_argument(
        "channel runs: need outer, channels, inner >= 1 and a run of at least outer * inner "
        "elements, a multiple of the group size");
  }
  return Runs{outer, channels, inner, run};
}
}  // namespace

int64_t quantize_runs_cpu(const void* x, int dtype, int64_t outer, int64_t channels,
                          int64_t inner, int64_t run, int64_t group_size, int bits, uint64_t seed,
                          bool zero_exact, uint8_t* out, float* lo, float* scale, int threads) {
  check_group_size(group_size);
  check_zero_exact(zero_exact, bits);
  const Runs runs = checked_runs(outer, channels, inner, run, group_size);
  const int64_t n = channels * run;
  dispatch<Quantize>(dtype, bits, x, n, group_size, quantize_key(seed), zero_exact, out, lo,
                     scale, threads, runs);
  return lossless_groups(scale, n / group_size);
}

void dequantize_cpu(const uint8_t* data, const float* lo, const float* scale, int64_t n,
                    int64_t group_size, int bits, uint64_t seed, bool zero_exact, int dtype,
                    void* out, int threads) {
  check_group_size(group_size);
  check_zero_exact(zero_exact, bits);
  if (n <= 0) return;
  dispatch<Dequantize>(dtype, bits, data, lo, scale, n, group_size, dequantize_key(seed),
                       zero_exact, out, threads, Runs{});
}

void dequantize_runs_cpu(const uint8_t* data, const float* lo, const float* scale, int64_t outer,
                         int64_t channels, int64_t inner, int64_t run, int64_t group_size,
                         int bits, uint64_t seed, bool zero_exact, int dtype, void* out,
                         int threads) {
  check_group_size(group_size);
  check_zero_exact(zero_exact, bits);
  const Runs runs = checked_runs(outer, channels, inner, run, group_size);
  dispatch<Dequantize>(dtype, bits, data, lo, scale, channels * run, group_size,
                       dequantize_key(seed), zero_exact, out, threads, runs);
}

void bucketize_cpu(const void* x, int dtype, int64_t n, const float* bounds, int nb, uint8_t* out,
                   int threads) {
  if (nb < 0 || nb > 255) throw std::invalid_argument("bucketize: at most 255 bounds");
  if (n <= 0) return;
  dispatch_float<Bucketize>(dtype, x, n, bounds, nb, out, threads);
}

bool pack_mask_cpu(const uint8_t* in, int64_t n, uint8_t* out, int threads) {
  const int64_t bytes = (n + 7) / 8;
  uint32_t invalid = 0;
#pragma omp parallel for num_threads(team_size(threads, n)) schedule(static) reduction(| : invalid)
  for (int64_t i = 0; i < bytes; ++i) {
    const int64_t m = std::min<int64_t>(8, n - i * 8);
    uint32_t byte = 0;
    for (int j = 0; j < m; ++j) {
      const uint8_t v = in[i * 8 + j];
      byte |= static_cast<uint32_t>(v != 0) << j;
      invalid |= v > 1;
    }
    out[i] = static_cast<uint8_t>(byte);
  }
  return invalid != 0;
}

void unpack_mask_cpu(const uint8_t* in, int64_t n, uint8_t* out, int threads) {
  const int64_t bytes = (n + 7) / 8;
#pragma omp parallel for num_threads(team_size(threads, n)) schedule(static)
  for (int64_t i = 0; i < bytes; ++i) {
    const int64_t m = std::min<int64_t>(8, n - i * 8);
    for (int j = 0; j < m; ++j) out[i * 8 + j] = (in[i] >> j) & 1;
  }
}

}  // namespace gact
