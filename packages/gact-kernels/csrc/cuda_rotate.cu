// CUDA rotation kernels: one thread block per rotation block (grid-stride over blocks), the
// block held in shared memory. Same bits as cpu_rotate.cpp: see the rotation rules of NOTE
// [storage and RNG invariants] in common.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "cuda_launch.cuh"
#include "kernels.h"

namespace gact {
namespace {

// The spec's butterflies, stage by stage; within a stage each pair is one thread's.
__device__ __forceinline__ void butterflies(float* buf, int64_t block) {
  for (int64_t h = 1; h < block; h <<= 1) {
    for (int64_t p = threadIdx.x; p < block / 2; p += blockDim.x) {
      const int64_t k = ((p & ~(h - 1)) << 1) | (p & (h - 1));
      const float a = buf[k], b = buf[k + h];
      buf[k] = f_add(a, b);
      buf[k + h] = f_sub(a, b);
    }
    __syncthreads();
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    rotate_kernel(const typename Elem<DT>::type* __restrict__ x, int64_t blocks, int64_t block,
                  StreamKey signs, float* __restrict__ out) {
  extern __shared__ float buf[];
  for (int64_t j = blockIdx.x; j < blocks; j += gridDim.x) {
    const int64_t first = j * block;
    for (int64_t i = threadIdx.x; i < block; i += blockDim.x) {
      const float v = Elem<DT>::load(x[first + i]);
      buf[i] = rotation_negates(signs, static_cast<uint32_t>(i)) ? -v : v;
    }
    __syncthreads();
    butterflies(buf, block);
    for (int64_t i = threadIdx.x; i < block; i += blockDim.x) out[first + i] = buf[i];
    __syncthreads();
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    unrotate_kernel(const float* __restrict__ y, int64_t blocks, int64_t block, StreamKey signs,
                    StreamKey key, float inv, typename Elem<DT>::type* __restrict__ out) {
  extern __shared__ float buf[];
  for (int64_t j = blockIdx.x; j < blocks; j += gridDim.x) {
    const int64_t first = j * block;
    for (int64_t i = threadIdx.x; i < block; i += blockDim.x) buf[i] = y[first + i];
    __syncthreads();
    butterflies(buf, block);
    for (int64_t i = threadIdx.x; i < block; i += blockDim.x) {
      const float v = f_mul(buf[i], inv);
      const uint64_t e = static_cast<uint64_t>(first + i);
      const uint32_t h = hash32(key, stream_high(key, e), static_cast<uint32_t>(e));
      out[first + i] = Elem<DT>::store(rotation_negates(signs, static_cast<uint32_t>(i)) ? -v : v, h);
    }
    __syncthreads();
  }
}

// The tail shorter than a block: copied by rotate, rounded to the output dtype by unrotate.
template <int DT>
__global__ void rotate_tail_kernel(const typename Elem<DT>::type* __restrict__ x, int64_t first,
                                   int64_t n, float* __restrict__ out) {
  for (int64_t e = first + threadIdx.x; e < n; e += blockDim.x) out[e] = Elem<DT>::load(x[e]);
}

template <int DT>
__global__ void unrotate_tail_kernel(const float* __restrict__ y, int64_t first, int64_t n,
                                     StreamKey key, typename Elem<DT>::type* __restrict__ out) {
  for (int64_t e = first + threadIdx.x; e < n; e += blockDim.x) {
    const uint64_t u = static_cast<uint64_t>(e);
    out[e] = Elem<DT>::store(y[e], hash32(key, stream_high(key, u), static_cast<uint32_t>(u)));
  }
}

int grid_for(int64_t blocks) { return static_cast<int>(std::min<int64_t>(blocks, kMaxBlocks)); }

template <int DT>
struct RotateLaunch {
  static void run(const void* x, int64_t n, int64_t block, float* out, cudaStream_t stream) {
    const auto* in = static_cast<const typename Elem<DT>::type*>(x);
    const int64_t blocks = n / block;
    if (blocks > 0) {
      rotate_kernel<DT><<<grid_for(blocks), kThreads, block * sizeof(float), stream>>>(
          in, blocks, block, quantize_key(kSignSeed), out);
    }
    if (blocks * block < n) rotate_tail_kernel<DT><<<1, kThreads, 0, stream>>>(in, blocks * block, n, out);
  }
};

template <int DT>
struct UnrotateLaunch {
  static void run(const float* y, int64_t n, int64_t block, uint64_t seed, void* out,
                  cudaStream_t stream) {
    auto* o = static_cast<typename Elem<DT>::type*>(out);
    const int64_t blocks = n / block;
    const StreamKey key = rotation_key(seed);
    if (blocks > 0) {
      unrotate_kernel<DT><<<grid_for(blocks), kThreads, block * sizeof(float), stream>>>(
          y, blocks, block, quantize_key(kSignSeed), key, 1.0f / static_cast<float>(block), o);
    }
    if (blocks * block < n) {
      unrotate_tail_kernel<DT><<<1, kThreads, 0, stream>>>(y, blocks * block, n, key, o);
    }
  }
};

}  // namespace

void rotate_cuda(const void* x, int dtype, int64_t n, int64_t block, float* out, int device,
                 void* stream) {
  check_rotation_block(block);
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch_float<RotateLaunch>(dtype, x, n, block, out, static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "rotate launch");
}

void unrotate_cuda(const float* y, int64_t n, int64_t block, uint64_t seed, int dtype, void* out,
                   int device, void* stream) {
  check_rotation_block(block);
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch_float<UnrotateLaunch>(dtype, y, n, block, seed, out, static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "unrotate launch");
}

}  // namespace gact
