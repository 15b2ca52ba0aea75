// Shared by the CPU kernels (cpu.cpp, cpu_ints.cpp, cpu_rotate.cpp): thread-team sizing and
// the SIMD clones of hot loops.
#pragma once

#include <omp.h>

#include <cstdint>

// Hot loops get AVX-512 and AVX2 clones picked at load time (ifunc); the default clone is
// baseline x86-64, so a wheel built here runs on any x86-64 CPU. All clones do the same IEEE
// operations (-ffp-contract=off forbids FMA contraction).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GACT_SIMD __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define GACT_SIMD
#endif

namespace gact {

constexpr int64_t kSerialBelow = 1 << 15;  // elements; smaller inputs run on one thread
// Groups are handed out dynamically in blocks, so a thread that loses its core to another
// process does not hold up the others. Every group is independent, so the bytes do not depend
// on which thread does it.
constexpr int kGroupsPerTask = 64;

inline int team_size(int threads, int64_t work) {
  if (work < kSerialBelow) return 1;
  return threads > 0 ? threads : omp_get_max_threads();
}

}  // namespace gact
