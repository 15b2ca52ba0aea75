// Thread-team sizing shared by the CPU kernels (cpu.cpp, cpu_ints.cpp).
#pragma once

#include <omp.h>

#include <cstdint>

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
