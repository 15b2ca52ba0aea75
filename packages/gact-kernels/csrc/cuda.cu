// CUDA kernels. One warp per group for quantize, one thread per 8-element chunk for dequantize,
// 64-bit indices and grid-stride loops everywhere. Launches are asynchronous on the caller's
// stream and never synchronise. See NOTE [storage and RNG invariants] in common.h.
#include "common.h"
#include "cuda_launch.cuh"
#include "kernels.h"

namespace gact {
namespace {

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Loads the `cnt` (<= 8) elements of a chunk as floats; missing elements read as 0.
template <int DT>
__device__ __forceinline__ void load_chunk(const typename Elem<DT>::type* p, int cnt,
                                           float (&v)[kChunk]) {
  if (cnt == kChunk && aligned16(p)) {
    if constexpr (DT == kFloat32) {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 a = *reinterpret_cast<const uint4*>(p);
      const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[2 * k] = Elem<DT>::load(static_cast<uint16_t>(w[k] & 0xFFFFu));
        v[2 * k + 1] = Elem<DT>::load(static_cast<uint16_t>(w[k] >> 16));
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = j < cnt ? Elem<DT>::load(p[j]) : 0.0f;
  }
}

// Stores the `cnt` (<= 8) values of a chunk; h holds each element's random word (fp16/bf16
// round stochastically, fp32 ignores it).
template <int DT>
__device__ __forceinline__ void store_chunk(typename Elem<DT>::type* p, int cnt,
                                            const float (&v)[kChunk],
                                            const uint32_t (&h)[kChunk]) {
  if (cnt == kChunk && aligned16(p)) {
    if constexpr (DT == kFloat32) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        w[k] = static_cast<uint32_t>(Elem<DT>::store(v[2 * k], h[2 * k])) |
               (static_cast<uint32_t>(Elem<DT>::store(v[2 * k + 1], h[2 * k + 1])) << 16);
      }
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
    for (int j = 0; j < cnt; ++j) p[j] = Elem<DT>::store(v[j], h[j]);
  }
}

// The b-bit codes of one chunk occupy B bytes (fewer for a partial last chunk). Whole words
// only where the address allows it: a container's `data` may be a view at any byte offset.
template <int B>
__device__ __forceinline__ bool whole_word(const uint8_t* p, int cnt) {
  return cnt == kChunk && (B == 8 || B == 4 || B == 2 || B == 1) &&
         (reinterpret_cast<uintptr_t>(p) & (B - 1)) == 0;
}

template <int B>
__device__ __forceinline__ void store_codes(uint8_t* dst, uint64_t w, int cnt) {
  if (whole_word<B>(dst, cnt)) {
    if constexpr (B == 8) *reinterpret_cast<uint64_t*>(dst) = w;
    if constexpr (B == 4) *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(w);
    if constexpr (B == 2) *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(w);
    if constexpr (B == 1) *dst = static_cast<uint8_t>(w);
  } else {
    const int bytes = (cnt * B + 7) / 8;
    for (int k = 0; k < bytes; ++k) dst[k] = static_cast<uint8_t>(w >> (8 * k));
  }
}

template <int B>
__device__ __forceinline__ uint64_t load_codes(const uint8_t* src, int cnt) {
  if (whole_word<B>(src, cnt)) {
    if constexpr (B == 8) return *reinterpret_cast<const uint64_t*>(src);
    if constexpr (B == 4) return *reinterpret_cast<const uint32_t*>(src);
    if constexpr (B == 2) return *reinterpret_cast<const uint16_t*>(src);
    return *src;
  }
  uint64_t w = 0;
  const int bytes = (cnt * B + 7) / 8;
  for (int k = 0; k < bytes; ++k) w |= static_cast<uint64_t>(src[k]) << (8 * k);
  return w;
}

template <int DT, int B>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const typename Elem<DT>::type* __restrict__ x, int64_t n, int64_t G,
                    StreamKey key, bool zero_exact, uint8_t* __restrict__ out,
                    float* __restrict__ lo, float* __restrict__ scale,
                    volatile uint8_t* lossless_flag) {
  const int lane = threadIdx.x & 31;
  const float levels = static_cast<float>((1 << B) - 1);
  const float top = static_cast<float>((1 << B) - 2);  // zero-exact grid: 2^b - 2
  constexpr float tiny = zero_exact_tiny<DT>();
  const int64_t groups = (n + G - 1) / G;
  const int64_t warps = grid_threads() / 32;
  for (int64_t g = global_thread() / 32; g < groups; g += warps) {
    const int64_t first = g * G;
    const int64_t m = min64(G, n - first);
    const int64_t chunks = (m + kChunk - 1) / kChunk;
    float mn = __int_as_float(0x7F800000), mx = -mn;
    uint32_t bad = 0;
    for (int64_t c = lane; c < chunks; c += 32) {
      const int cnt = static_cast<int>(min64(kChunk, m - c * kChunk));
      float v[kChunk];
      load_chunk<DT>(x + first + c * kChunk, cnt, v);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (j < cnt) {
          mn = f_min(v[j], mn);
          mx = f_max(v[j], mx);
          bad |= is_nonfinite(v[j]);
        }
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      mn = f_min(__shfl_xor_sync(0xFFFFFFFFu, mn, off), mn);
      mx = f_max(__shfl_xor_sync(0xFFFFFFFFu, mx, off), mx);
      bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, off);
    }
    const GroupParams p = group_params(mn, mx, bad, levels, zero_exact, tiny);
    if (lane == 0) {
      lo[g] = p.lo;
      scale[g] = p.scale;
      if (lossless_flag != nullptr && p.scale != p.scale) {  // a NaN step: stored losslessly
        *lossless_flag = 1;  // mapped host memory, read after the stream passes this kernel
        __threadfence_system();
      }
    }
    // False for constant (0) and flagged (NaN) groups; a zero-exact group is coded even with a
    // step of 0 (its positives get code 1). Both are uniform over the warp.
    const bool coded = p.scale > 0.0f || p.zero_exact;
    for (int64_t c = lane; c < chunks; c += 32) {
      const int cnt = static_cast<int>(min64(kChunk, m - c * kChunk));
      const int64_t e0 = first + c * kChunk;
      uint64_t w = 0;
      if (coded) {
        float v[kChunk];
        load_chunk<DT>(x + e0, cnt, v);
        // A chunk never straddles a multiple of 2^32 (e0 is a multiple of 8).
        const uint32_t high = stream_high(key, static_cast<uint64_t>(e0));
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          if (j < cnt) {
            const uint32_t e_low = static_cast<uint32_t>(e0) + j;
            const float u = uniform24(key, high, e_low);
            const uint32_t q = p.zero_exact
                                   ? quantize_zero_exact_one(v[j], tiny, p.scale, top, u)
                                   : quantize_one(v[j], p.lo, p.scale, levels, u);
            w |= static_cast<uint64_t>(q) << (j * B);
          }
        }
      }
      store_codes<B>(out + e0 / kChunk * B, w, cnt);
    }
  }
}

template <int DT, int B>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ data, const float* __restrict__ lo,
                      const float* __restrict__ scale, int64_t n, int64_t G, StreamKey key,
                      bool zero_exact, typename Elem<DT>::type* __restrict__ out) {
  constexpr uint64_t mask = (1u << B) - 1;
  constexpr float tiny = zero_exact_tiny<DT>();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  for (int64_t c = global_thread(); c < chunks; c += grid_threads()) {
    const int64_t e0 = c * kChunk;
    const int cnt = static_cast<int>(min64(kChunk, n - e0));
    const int64_t g = e0 / G;
    const float l = lo[g], s = scale[g];
    const bool zx = zero_exact_group(zero_exact, l);  // uniform over the chunk
    const uint64_t w = load_codes<B>(data + c * B, cnt);
    float v[kChunk];
    uint32_t h[kChunk] = {};
    // A chunk never straddles a multiple of 2^32 (e0 is a multiple of 8).
    const uint32_t high = stream_high(key, static_cast<uint64_t>(e0));
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const uint32_t q = static_cast<uint32_t>((w >> (j * B)) & mask);
      v[j] = zx ? dequantize_zero_exact_one(q, tiny, s) : dequantize_one(q, l, s);
      if constexpr (DT != kFloat32) h[j] = hash32(key, high, static_cast<uint32_t>(e0) + j);
    }
    store_chunk<DT>(out + e0, cnt, v, h);
  }
}

__global__ void __launch_bounds__(kThreads)
    pack_mask_kernel(const uint8_t* __restrict__ in, int64_t n, uint8_t* __restrict__ out) {
  const int64_t bytes = (n + 7) / 8;
  for (int64_t i = global_thread(); i < bytes; i += grid_threads()) {
    const uint8_t* p = in + i * 8;
    const int cnt = static_cast<int>(min64(8, n - i * 8));
    uint32_t byte = 0;
    if (cnt == 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      const uint64_t w = *reinterpret_cast<const uint64_t*>(p);
#pragma unroll
      for (int j = 0; j < 8; ++j) byte |= static_cast<uint32_t>(((w >> (8 * j)) & 0xFF) != 0) << j;
    } else {
      for (int j = 0; j < cnt; ++j) byte |= static_cast<uint32_t>(p[j] != 0) << j;
    }
    out[i] = static_cast<uint8_t>(byte);
  }
}

__global__ void __launch_bounds__(kThreads)
    unpack_mask_kernel(const uint8_t* __restrict__ in, int64_t n, uint8_t* __restrict__ out) {
  const int64_t bytes = (n + 7) / 8;
  for (int64_t i = global_thread(); i < bytes; i += grid_threads()) {
    uint8_t* p = out + i * 8;
    const int cnt = static_cast<int>(min64(8, n - i * 8));
    const uint32_t byte = in[i];
    if (cnt == 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      uint64_t w = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>((byte >> j) & 1) << (8 * j);
      *reinterpret_cast<uint64_t*>(p) = w;
    } else {
      for (int j = 0; j < cnt; ++j) p[j] = (byte >> j) & 1;
    }
  }
}

template <int DT, int B>
struct Quantize {
  static void run(const void* x, int64_t n, int64_t G, StreamKey key, bool zero_exact,
                  uint8_t* out, float* lo, float* scale, uint8_t* lossless_flag,
                  cudaStream_t stream) {
    const int64_t groups = (n + G - 1) / G;
    quantize_kernel<DT, B><<<blocks_for(groups * 32), kThreads, 0, stream>>>(
        static_cast<const typename Elem<DT>::type*>(x), n, G, key, zero_exact, out, lo, scale,
        lossless_flag);
  }
};

template <int DT, int B>
struct Dequantize {
  static void run(const uint8_t* data, const float* lo, const float* scale, int64_t n, int64_t G,
                  StreamKey key, bool zero_exact, void* out, cudaStream_t stream) {
    dequantize_kernel<DT, B><<<blocks_for((n + kChunk - 1) / kChunk), kThreads, 0, stream>>>(
        data, lo, scale, n, G, key, zero_exact, static_cast<typename Elem<DT>::type*>(out));
  }
};

}  // namespace

void quantize_cuda(const void* x, int dtype, int64_t n, int64_t group_size, int bits,
                   uint64_t seed, bool zero_exact, uint8_t* out, float* lo, float* scale,
                   uint8_t* lossless_flag, int device, void* stream) {
  check_group_size(group_size);
  check_zero_exact(zero_exact, bits);
  if (lossless_flag != nullptr) *lossless_flag = 0;  // before the launch: the kernel only sets it
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch<Quantize>(dtype, bits, x, n, group_size, quantize_key(seed), zero_exact, out, lo,
                     scale, lossless_flag, static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "quantize launch");
}

bool device_addressable(const void* host) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, host) != cudaSuccess) {
    cudaGetLastError();  // clear the error a failed query records
    return false;
  }
  return attr.type == cudaMemoryTypeHost && attr.devicePointer == host;
}

void dequantize_cuda(const uint8_t* data, const float* lo, const float* scale, int64_t n,
                     int64_t group_size, int bits, uint64_t seed, bool zero_exact, int dtype,
                     void* out, int device, void* stream) {
  check_group_size(group_size);
  check_zero_exact(zero_exact, bits);
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch<Dequantize>(dtype, bits, data, lo, scale, n, group_size, dequantize_key(seed),
                       zero_exact, out, static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "dequantize launch");
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    bucketize_kernel(const typename Elem<DT>::type* __restrict__ x, int64_t n,
                     const float* __restrict__ bounds, int nb, uint8_t* __restrict__ out) {
  __shared__ float b[255];
  for (int k = threadIdx.x; k < nb; k += blockDim.x) b[k] = bounds[k];
  __syncthreads();
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const float v = Elem<DT>::load(x[i]);
    uint32_t code = 0;
    for (int k = 0; k < nb; ++k) code += !(v <= b[k]);
    out[i] = static_cast<uint8_t>(code);
  }
}

template <int DT>
struct BucketizeLaunch {
  static void run(const void* x, int64_t n, const float* bounds, int nb, uint8_t* out,
                  cudaStream_t stream) {
    bucketize_kernel<DT><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<const typename Elem<DT>::type*>(x), n, bounds, nb, out);
  }
};

void bucketize_cuda(const void* x, int dtype, int64_t n, const float* bounds, int nb,
                    uint8_t* out, int device, void* stream) {
  if (nb < 0 || nb > 255) throw std::invalid_argument("bucketize: at most 255 bounds");
  if (n <= 0) return;
  DeviceGuard guard(device);
  dispatch_float<BucketizeLaunch>(dtype, x, n, bounds, nb, out, static_cast<cudaStream_t>(stream));
  check(cudaGetLastError(), "bucketize launch");
}

void pack_mask_cuda(const uint8_t* in, int64_t n, uint8_t* out, int device, void* stream) {
  if (n <= 0) return;
  DeviceGuard guard(device);
  pack_mask_kernel<<<blocks_for((n + 7) / 8), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      in, n, out);
  check(cudaGetLastError(), "pack_mask launch");
}

void unpack_mask_cuda(const uint8_t* in, int64_t n, uint8_t* out, int device, void* stream) {
  if (n <= 0) return;
  DeviceGuard guard(device);
  unpack_mask_kernel<<<blocks_for((n + 7) / 8), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      in, n, out);
  check(cudaGetLastError(), "unpack_mask launch");
}

}  // namespace gact
