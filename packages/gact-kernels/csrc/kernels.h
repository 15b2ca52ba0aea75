// Entry points of the CPU and CUDA kernels. Pointers are raw device/host addresses handed over
// by the Python wrapper; sizes are 64-bit. No torch or CUDA header is needed to include this.
#pragma once

#include <cstdint>

namespace gact {

// x: n elements of dtype (0 fp32, 1 fp16, 2 bf16); out: ceil(n*bits/8) bytes;
// lo, scale: ceil(n/group_size) floats each.
void quantize_cpu(const void* x, int dtype, int64_t n, int64_t group_size, int bits,
                  uint64_t seed, uint8_t* out, float* lo, float* scale, int threads);
void dequantize_cpu(const uint8_t* data, const float* lo, const float* scale, int64_t n,
                    int64_t group_size, int bits, int dtype, void* out, int threads);
// in: n bytes (0/1); out: ceil(n/8) bytes. Returns true if an input byte was > 1.
bool pack_mask_cpu(const uint8_t* in, int64_t n, uint8_t* out, int threads);
void unpack_mask_cpu(const uint8_t* in, int64_t n, uint8_t* out, int threads);

// Same contracts on a CUDA device; `stream` is a cudaStream_t, launches are asynchronous.
void quantize_cuda(const void* x, int dtype, int64_t n, int64_t group_size, int bits,
                   uint64_t seed, uint8_t* out, float* lo, float* scale, int device,
                   void* stream);
void dequantize_cuda(const uint8_t* data, const float* lo, const float* scale, int64_t n,
                     int64_t group_size, int bits, int dtype, void* out, int device,
                     void* stream);
// Bytes > 1 are packed as 1 (no validation on the device: it would need a sync).
void pack_mask_cuda(const uint8_t* in, int64_t n, uint8_t* out, int device, void* stream);
void unpack_mask_cuda(const uint8_t* in, int64_t n, uint8_t* out, int device, void* stream);

}  // namespace gact
