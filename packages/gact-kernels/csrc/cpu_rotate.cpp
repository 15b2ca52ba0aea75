// CPU rotation kernels: OpenMP over blocks, each rotated in a thread-local float32 buffer.
// See the rotation rules of NOTE [storage and RNG invariants] in common.h.
#include <cstdint>
#include <vector>

#include "common.h"
#include "cpu_threads.h"
#include "kernels.h"

namespace gact {
namespace {

// The butterflies of one block. Any order of the pairs within a stage gives the same bits
// (each pair's two operations read only that pair): the stages h = 1, 2, 4 run on each run of
// 8 elements straight-line, the later ones over contiguous halves, which vectorise.
GACT_SIMD void butterflies(float* __restrict y, int64_t block) {
  int64_t first = 1;
  if (block >= 8) {
    for (int64_t c = 0; c < block; c += 8) {
      float* v = y + c;
      const float b0 = f_add(v[0], v[1]), b1 = f_sub(v[0], v[1]);
      const float b2 = f_add(v[2], v[3]), b3 = f_sub(v[2], v[3]);
      const float b4 = f_add(v[4], v[5]), b5 = f_sub(v[4], v[5]);
      const float b6 = f_add(v[6], v[7]), b7 = f_sub(v[6], v[7]);
      const float c0 = f_add(b0, b2), c2 = f_sub(b0, b2), c1 = f_add(b1, b3), c3 = f_sub(b1, b3);
      const float c4 = f_add(b4, b6), c6 = f_sub(b4, b6), c5 = f_add(b5, b7), c7 = f_sub(b5, b7);
      v[0] = f_add(c0, c4), v[4] = f_sub(c0, c4), v[1] = f_add(c1, c5), v[5] = f_sub(c1, c5);
      v[2] = f_add(c2, c6), v[6] = f_sub(c2, c6), v[3] = f_add(c3, c7), v[7] = f_sub(c3, c7);
    }
    first = 8;
  }
  for (int64_t h = first; h < block; h <<= 1) {
    for (int64_t i = 0; i < block; i += 2 * h) {
      float* __restrict a = y + i;
      float* __restrict b = y + i + h;
      for (int64_t k = 0; k < h; ++k) {
        const float p = a[k], q = b[k];
        a[k] = f_add(p, q);
        b[k] = f_sub(p, q);
      }
    }
  }
}

// The block's signs as floats (multiplying by +-1 is exact and vectorises).
std::vector<float> signs_of(int64_t block) {
  const StreamKey key = quantize_key(kSignSeed);
  std::vector<float> out(block);
  for (int64_t i = 0; i < block; ++i) {
    out[i] = rotation_negates(key, static_cast<uint32_t>(i)) ? -1.0f : 1.0f;
  }
  return out;
}

template <int DT>
GACT_SIMD void load_signed(const typename Elem<DT>::type* __restrict x, const float* __restrict s,
                           int64_t block, float* __restrict y) {
  for (int64_t i = 0; i < block; ++i) y[i] = f_mul(Elem<DT>::load(x[i]), s[i]);
}

template <int DT>
struct Rotate {
  static void run(const void* x, int64_t n, int64_t block, float* out, int threads) {
    const auto* in = static_cast<const typename Elem<DT>::type*>(x);
    const std::vector<float> signs = signs_of(block);
    const int64_t blocks = n / block;
#pragma omp parallel for num_threads(team_size(threads, n)) schedule(dynamic, kGroupsPerTask)
    for (int64_t j = 0; j < blocks; ++j) {
      float* y = out + j * block;
      load_signed<DT>(in + j * block, signs.data(), block, y);
      butterflies(y, block);
    }
    for (int64_t e = blocks * block; e < n; ++e) out[e] = Elem<DT>::load(in[e]);
  }
};

template <int DT>
struct Unrotate {
  static void run(const float* y, int64_t n, int64_t block, uint64_t seed, void* out,
                  int threads) {
    auto* o = static_cast<typename Elem<DT>::type*>(out);
    const std::vector<float> signs = signs_of(block);
    const StreamKey key = rotation_key(seed);
    const float inv = 1.0f / static_cast<float>(block);  // a power of two: exact
    const int64_t blocks = n / block;
#pragma omp parallel num_threads(team_size(threads, n))
    {
      std::vector<float> buf(block);
#pragma omp for schedule(dynamic, kGroupsPerTask)
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t first = j * block;
        for (int64_t i = 0; i < block; ++i) buf[i] = y[first + i];
        butterflies(buf.data(), block);
        for (int64_t i = 0; i < block; ++i) {
          const float v = f_mul(buf[i], inv);
          const uint64_t e = static_cast<uint64_t>(first + i);
          const uint32_t h = hash32(key, stream_high(key, e), static_cast<uint32_t>(e));
          o[first + i] = Elem<DT>::store(f_mul(v, signs[i]), h);
        }
      }
    }
    for (int64_t e = blocks * block; e < n; ++e) {
      const uint64_t u = static_cast<uint64_t>(e);
      o[e] = Elem<DT>::store(y[e], hash32(key, stream_high(key, u), static_cast<uint32_t>(u)));
    }
  }
};

}  // namespace

void rotate_cpu(const void* x, int dtype, int64_t n, int64_t block, float* out, int threads) {
  check_rotation_block(block);
  if (n <= 0) return;
  dispatch_float<Rotate>(dtype, x, n, block, out, threads);
}

void unrotate_cpu(const float* y, int64_t n, int64_t block, uint64_t seed, int dtype, void* out,
                  int threads) {
  check_rotation_block(block);
  if (n <= 0) return;
  dispatch_float<Unrotate>(dtype, y, n, block, seed, out, threads);
}

}  // namespace gact
