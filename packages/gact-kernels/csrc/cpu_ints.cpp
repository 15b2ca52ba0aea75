// CPU kernels of the lossless integer packing: OpenMP over groups, one bit stream per group.
// See NOTE [storage and RNG invariants] ("Integer packing") in common.h.
#include <algorithm>
#include <cstring>

#include "common.h"
#include "cpu_threads.h"
#include "kernels.h"

namespace gact {
namespace {

template <int DT>
struct Params {
  static void run(const void* xv, int64_t n, int64_t G, int64_t* mins, uint8_t* widths,
                  int threads) {
    using T = typename IntElem<DT>::type;
    const T* x = static_cast<const T*>(xv);
    const int64_t groups = (n + G - 1) / G;
#pragma omp parallel for num_threads(team_size(threads, n)) schedule(dynamic, kGroupsPerTask)
    for (int64_t g = 0; g < groups; ++g) {
      const T* xs = x + g * G;
      const int64_t m = std::min(G, n - g * G);
      T mn = xs[0], mx = xs[0];
      for (int64_t j = 1; j < m; ++j) {  // native-width min/max vectorises
        mn = xs[j] < mn ? xs[j] : mn;
        mx = xs[j] > mx ? xs[j] : mx;
      }
      mins[g] = static_cast<int64_t>(mn);
      widths[g] = static_cast<uint8_t>(
          bit_width(static_cast<uint64_t>(static_cast<int64_t>(mx)) - static_cast<uint64_t>(mins[g])));
    }
  }
};

template <int DT>
struct Pack {
  static void run(const void* xv, int64_t n, int64_t G, const int64_t* mins,
                  const uint8_t* widths, const int64_t* starts, uint8_t* out, int threads) {
    using T = typename IntElem<DT>::type;
    const T* x = static_cast<const T*>(xv);
    const int64_t groups = (n + G - 1) / G;
#pragma omp parallel for num_threads(team_size(threads, n)) schedule(dynamic, kGroupsPerTask)
    for (int64_t g = 0; g < groups; ++g) {
      const int w = widths[g];
      if (w == 0) continue;
      const T* xs = x + g * G;
      const int64_t m = std::min(G, n - g * G);
      const uint64_t mn = static_cast<uint64_t>(mins[g]);
      BitWriter writer(out + starts[g]);
      for (int64_t j = 0; j < m; ++j) {
        writer.put(static_cast<uint64_t>(static_cast<int64_t>(xs[j])) - mn, w);
      }
      writer.finish();
    }
  }
};

// Code j of a w-bit stream (w <= 56) lies inside the 8 bytes starting at byte (j*w) / 8: one
// unaligned load and a shift, no dependency between codes. The last codes, whose 8-byte window
// would pass the end of the stream, are read from a zero-padded copy of its tail.
template <typename T>
void unpack_narrow(const uint8_t* src, int64_t bytes, int64_t m, int w, uint64_t mn, T* ys) {
  const uint64_t mask = low_bits(w);
  const int64_t safe = bytes >= 8 ? std::min<int64_t>(m, (bytes - 8) * 8 / w + 1) : 0;
  for (int64_t j = 0; j < safe; ++j) {
    const int64_t bit = j * w;
    uint64_t v;
    std::memcpy(&v, src + (bit >> 3), 8);
    ys[j] = static_cast<T>(mn + ((v >> (bit & 7)) & mask));
  }
  const int64_t base = (safe * w) >> 3;
  uint8_t tail[16] = {};
  std::memcpy(tail, src + base, static_cast<size_t>(bytes - base));
  for (int64_t j = safe; j < m; ++j) {
    const int64_t bit = j * w - base * 8;
    uint64_t v;
    std::memcpy(&v, tail + (bit >> 3), 8);
    ys[j] = static_cast<T>(mn + ((v >> (bit & 7)) & mask));
  }
}

template <int DT>
struct Unpack {
  static void run(const uint8_t* data, int64_t data_bytes, const int64_t* mins,
                  const uint8_t* widths, const int64_t* starts, int64_t n, int64_t G, void* outv,
                  int threads) {
    using T = typename IntElem<DT>::type;
    T* out = static_cast<T*>(outv);
    const int64_t groups = (n + G - 1) / G;
#pragma omp parallel for num_threads(team_size(threads, n)) schedule(dynamic, kGroupsPerTask)
    for (int64_t g = 0; g < groups; ++g) {
      T* ys = out + g * G;
      const int64_t m = std::min(G, n - g * G);
      const int w = widths[g];
      const int64_t bytes = packed_bytes(m, w);
      const bool readable = w <= 64 && starts[g] >= 0 && starts[g] <= data_bytes - bytes;
      const uint64_t mn = static_cast<uint64_t>(mins[g]);
      if (w == 0 || !readable) {  // malformed groups come back as their minimum, never read
        std::fill(ys, ys + m, static_cast<T>(mn));
        continue;
      }
      if (w <= 56) {
        unpack_narrow(data + starts[g], bytes, m, w, mn, ys);
      } else {
        BitReader reader(data + starts[g], bytes);
        for (int64_t j = 0; j < m; ++j) ys[j] = static_cast<T>(mn + reader.take(w));
      }
    }
  }
};

}  // namespace

void int_params_cpu(const void* x, int dtype, int64_t n, int64_t group_size, int64_t* mins,
                    uint8_t* widths, int threads) {
  check_group_size(group_size);
  if (n <= 0) return;
  dispatch_int<Params>(dtype, x, n, group_size, mins, widths, threads);
}

void pack_ints_cpu(const void* x, int dtype, int64_t n, int64_t group_size, const int64_t* mins,
                   const uint8_t* widths, const int64_t* starts, uint8_t* out, int threads) {
  check_group_size(group_size);
  if (n <= 0) return;
  dispatch_int<Pack>(dtype, x, n, group_size, mins, widths, starts, out, threads);
}

void unpack_ints_cpu(const uint8_t* data, int64_t data_bytes, const int64_t* mins,
                     const uint8_t* widths, const int64_t* starts, int64_t n,
                     int64_t group_size, int dtype, void* out, int threads) {
  check_group_size(group_size);
  if (n <= 0) return;
  dispatch_int<Unpack>(dtype, data, data_bytes, mins, widths, starts, n, group_size, out,
                       threads);
}

}  // namespace gact
