// CUDA kernels of the lossless integer packing: one warp per group for the group parameters,
// one thread per 8-element chunk (exactly w bytes) for packing and unpacking; 64-bit indices,
// grid-stride loops, asynchronous on the caller's stream. The caller's prefix sum of the group
// sizes sits between int_params and pack_ints (see kernels.h). See NOTE [storage and RNG
// invariants] ("Integer packing") in common.h.
#include "common.h"
#include "cuda_launch.cuh"
#include "kernels.h"

namespace gact {
namespace {

template <int DT>
__global__ void __launch_bounds__(kThreads)
    int_params_kernel(const typename IntElem<DT>::type* __restrict__ x, int64_t n, int64_t G,
                      int64_t* __restrict__ mins, uint8_t* __restrict__ widths) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = (n + G - 1) / G;
  const int64_t warps = grid_threads() / 32;
  for (int64_t g = global_thread() / 32; g < groups; g += warps) {
    const int64_t first = g * G;
    const int64_t m = min64(G, n - first);
    long long mn = static_cast<long long>(x[first]), mx = mn;
    for (int64_t j = lane; j < m; j += 32) {
      const long long v = static_cast<long long>(x[first + j]);
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const long long omn = __shfl_xor_sync(0xFFFFFFFFu, mn, off);
      const long long omx = __shfl_xor_sync(0xFFFFFFFFu, mx, off);
      mn = omn < mn ? omn : mn;
      mx = omx > mx ? omx : mx;
    }
    if (lane == 0) {
      mins[g] = mn;
      widths[g] = static_cast<uint8_t>(
          bit_width(static_cast<uint64_t>(mx) - static_cast<uint64_t>(mn)));
    }
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    pack_ints_kernel(const typename IntElem<DT>::type* __restrict__ x, int64_t n, int64_t G,
                     const int64_t* __restrict__ mins, const uint8_t* __restrict__ widths,
                     const int64_t* __restrict__ starts, uint8_t* __restrict__ out) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  for (int64_t c = global_thread(); c < chunks; c += grid_threads()) {
    const int64_t e0 = c * kChunk;
    const int64_t g = e0 / G;
    const int w = widths[g];
    if (w == 0) continue;
    const int cnt = static_cast<int>(min64(kChunk, n - e0));
    const uint64_t mn = static_cast<uint64_t>(mins[g]);
    BitWriter writer(out + starts[g] + (e0 - g * G) / kChunk * w);
    for (int j = 0; j < cnt; ++j) {
      writer.put(static_cast<uint64_t>(static_cast<int64_t>(x[e0 + j])) - mn, w);
    }
    writer.finish();
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    unpack_ints_kernel(const uint8_t* __restrict__ data, int64_t data_bytes,
                       const int64_t* __restrict__ mins, const uint8_t* __restrict__ widths,
                       const int64_t* __restrict__ starts, int64_t n, int64_t G,
                       typename IntElem<DT>::type* __restrict__ out) {
  using T = typename IntElem<DT>::type;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  for (int64_t c = global_thread(); c < chunks; c += grid_threads()) {
    const int64_t e0 = c * kChunk;
    const int64_t g = e0 / G;
    const int cnt = static_cast<int>(min64(kChunk, n - e0));
    const int w = widths[g];
    const uint64_t mn = static_cast<uint64_t>(mins[g]);
    // The whole group must lie inside the payload, or it is not read (malformed container).
    const int64_t group_bytes = packed_bytes(min64(G, n - g * G), w);
    const bool readable = w <= 64 && starts[g] >= 0 && starts[g] <= data_bytes - group_bytes;
    if (w == 0 || !readable) {
      for (int j = 0; j < cnt; ++j) out[e0 + j] = static_cast<T>(mn);
      continue;
    }
    BitReader reader(data + starts[g] + (e0 - g * G) / kChunk * w, packed_bytes(cnt, w));
    for (int j = 0; j < cnt; ++j) out[e0 + j] = static_cast<T>(mn + reader.take(w));
  }
}

template <int DT>
struct Params {
  static void run(const void* x, int64_t n, int64_t G, int64_t* mins, uint8_t* widths,
                  cudaStream_t stream) {
    const int64_t groups = (n + G - 1) / G;
    int_params_kernel<DT><<<blocks_for(groups * 32), kThreads, 0, stream>>>(
        static_cast<const typename IntElem<DT>::type*>(x), n, G, mins, widths);
  }
};

template <int DT>
struct Pack {
  static void run(const void* x, int64_t n, int64_t G, const int64_t* mins,
                  const uint8_t* widths, const int64_t* starts, uint8_t* out,
                  cudaStream_t stream) {
    pack_ints_kernel<DT><<<blocks_for((n + kChunk - 1) / kChunk), kThreads, 0, stream>>>(
        static_cast<const typename IntElem<DT>::type*>(x), n, G, mins, widths, starts, out);
  }
};

template <int DT>
struct Unpack {
  static void run(const uint8_t* data, int64_t data_bytes, const int64_t* mins,
                  const uint8_t* widths, const int64_t* starts, int64_t n, int64_t G, void* out,
                  cudaStream_t stream) {
    unpack_ints_kernel<DT><<<blocks_for((n + kChunk - 1) / kChunk), kThreads, 0, stream>>>(
        data, data_bytes, mins, widths, starts, n, G,
        static_cast<typename IntElem<DT>::type*>(out));
  }
};

}  // namespace

void int_params_cuda(const void* x, int dtype, int64_t n, int64_t group_size, int64_t* mins,
                     uint8_t* widths, int device, void* stream) {
  check_group_size(group_size);
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch_int<Params>(dtype, x, n, group_size, mins, widths, static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "int_params launch");
}

void pack_ints_cuda(const void* x, int dtype, int64_t n, int64_t group_size, const int64_t* mins,
                    const uint8_t* widths, const int64_t* starts, uint8_t* out, int device,
                    void* stream) {
  check_group_size(group_size);
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch_int<Pack>(dtype, x, n, group_size, mins, widths, starts, out,
                     static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "pack_ints launch");
}

void unpack_ints_cuda(const uint8_t* data, int64_t data_bytes, const int64_t* mins,
                      const uint8_t* widths, const int64_t* starts, int64_t n,
                      int64_t group_size, int dtype, void* out, int device, void* stream) {
  check_group_size(group_size);
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch_int<Unpack>(dtype, data, data_bytes, mins, widths, starts, n, group_size, out,
                       static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "unpack_ints launch");
}

}  // namespace gact
