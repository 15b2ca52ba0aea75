// Entry points of the CPU and CUDA kernels. Pointers are raw device/host addresses handed over
// by the Python wrapper; sizes are 64-bit. No torch or CUDA header is needed to include this.
// Formats: NOTE [storage and RNG invariants] in common.h.
#pragma once

#include <cstdint>

namespace gact {

// x: n elements of dtype (0 fp32, 1 fp16, 2 bf16) in memory order; out: ceil(n*bits/8) bytes;
// lo, scale: ceil(n/group_size) floats each. `seed` selects the rounding noise; dequantize
// derives its own stream (fp16/bf16 outputs are rounded stochastically) from the same seed.
// zero_exact (bits >= 2): groups whose minimum is zero use the sign-exact grid; dequantize
// must be given the same flag. quantize_cpu returns how many groups it stored losslessly (NaN
// scale): the caller gathers their elements only when there are some.
int64_t quantize_cpu(const void* x, int dtype, int64_t n, int64_t group_size, int bits,
                  uint64_t seed, bool zero_exact, uint8_t* out, float* lo, float* scale,
                  int threads);
void dequantize_cpu(const uint8_t* data, const float* lo, const float* scale, int64_t n,
                    int64_t group_size, int bits, uint64_t seed, bool zero_exact, int dtype,
                    void* out, int threads);
// Whether this CPU has the byte permutes (AVX-512 VBMI) of NOTE [odd widths] (cpu_pack.h), and
// a switch between that path and the portable one (on by default where supported; both write
// the same bytes). use_vbmi_cpu returns the previous setting and throws std::invalid_argument
// when asked for VBMI on a CPU without it.
bool vbmi_supported_cpu();
bool use_vbmi_cpu(bool on);
// The same on the channel-major block of NOTE [channel groups] (_layout.py), read from and
// written to its tensor in place: x (out) is [outer][channels][inner] in memory; each
// channel's outer * inner elements, padded to `run` (a multiple of group_size) by repeating
// the last, are the block's next run. Same bytes and values as the plain kernels on the block.
int64_t quantize_runs_cpu(const void* x, int dtype, int64_t outer, int64_t channels,
                          int64_t inner, int64_t run, int64_t group_size, int bits, uint64_t seed,
                          bool zero_exact, uint8_t* out, float* lo, float* scale, int threads);
void dequantize_runs_cpu(const uint8_t* data, const float* lo, const float* scale, int64_t outer,
                         int64_t channels, int64_t inner, int64_t run, int64_t group_size,
                         int bits, uint64_t seed, bool zero_exact, int dtype, void* out,
                         int threads);
// in: n bytes (0/1); out: ceil(n/8) bytes. Returns true if an input byte was > 1.
bool pack_mask_cpu(const uint8_t* in, int64_t n, uint8_t* out, int threads);
void unpack_mask_cpu(const uint8_t* in, int64_t n, uint8_t* out, int threads);
// x: n elements of float dtype 0..2; bounds: nb <= 255 non-decreasing floats (values of x's
// dtype); out[i] = the number of bounds b with !(x[i] <= b), as torch.bucketize(x, bounds)
// counts them (NaN -> nb).
void bucketize_cpu(const void* x, int dtype, int64_t n, const float* bounds, int nb, uint8_t* out,
                   int threads);
// Integer packing, dtype 3..7 (uint8, int8, int16, int32, int64). int_params writes each
// group's minimum and code width; the caller sums the groups' byte counts into `starts`
// (exclusive prefix sum) and sizes `out`; pack_ints then writes the codes. unpack_ints fills
// a group whose width exceeds 64 or whose bytes do not lie inside data[0, data_bytes) with its
// minimum instead of reading out of bounds.
void int_params_cpu(const void* x, int dtype, int64_t n, int64_t group_size, int64_t* mins,
                    uint8_t* widths, int threads);
void pack_ints_cpu(const void* x, int dtype, int64_t n, int64_t group_size, const int64_t* mins,
                   const uint8_t* widths, const int64_t* starts, uint8_t* out, int threads);
void unpack_ints_cpu(const uint8_t* data, int64_t data_bytes, const int64_t* mins,
                     const uint8_t* widths, const int64_t* starts, int64_t n,
                     int64_t group_size, int dtype, void* out, int threads);
// Rotation (NOTE [storage and RNG invariants]): x, n elements of float dtype 0..2, to float32
// out; unrotate: float32 y to n elements of float dtype 0..2 (16-bit ones rounded
// stochastically from `seed`). block: a power of two in [2, 4096].
void rotate_cpu(const void* x, int dtype, int64_t n, int64_t block, float* out, int threads);
void unrotate_cpu(const float* y, int64_t n, int64_t block, uint64_t seed, int dtype, void* out,
                  int threads);

// Same contracts on a CUDA device; `stream` is a cudaStream_t, launches are asynchronous.
// quantize_cuda cannot return the lossless count without synchronising; instead, given a
// `lossless_flag` byte of page-locked host memory that the device addresses at the same
// address (device_addressable; or nullptr), it sets the byte to 0 before the launch and the
// kernel sets it to 1 if it stores a group losslessly: once the stream has passed the kernel,
// 0 proves there is none (NOTE [Deferred lossless check] in pending.py).
void quantize_cuda(const void* x, int dtype, int64_t n, int64_t group_size, int bits,
                   uint64_t seed, bool zero_exact, uint8_t* out, float* lo, float* scale,
                   uint8_t* lossless_flag, int device, void* stream);
// Whether `host` is page-locked host memory that kernels may address at the same address
// (cudaHostAlloc'ed memory under unified addressing: torch's pinned memory).
bool device_addressable(const void* host);
void dequantize_cuda(const uint8_t* data, const float* lo, const float* scale, int64_t n,
                     int64_t group_size, int bits, uint64_t seed, bool zero_exact, int dtype,
                     void* out, int device, void* stream);
// Bytes > 1 are packed as 1 (no validation on the device: it would need a sync).
void bucketize_cuda(const void* x, int dtype, int64_t n, const float* bounds, int nb,
                    uint8_t* out, int device, void* stream);
void pack_mask_cuda(const uint8_t* in, int64_t n, uint8_t* out, int device, void* stream);
void unpack_mask_cuda(const uint8_t* in, int64_t n, uint8_t* out, int device, void* stream);
void int_params_cuda(const void* x, int dtype, int64_t n, int64_t group_size, int64_t* mins,
                     uint8_t* widths, int device, void* stream);
void pack_ints_cuda(const void* x, int dtype, int64_t n, int64_t group_size, const int64_t* mins,
                    const uint8_t* widths, const int64_t* starts, uint8_t* out, int device,
                    void* stream);
void unpack_ints_cuda(const uint8_t* data, int64_t data_bytes, const int64_t* mins,
                      const uint8_t* widths, const int64_t* starts, int64_t n,
                      int64_t group_size, int dtype, void* out, int device, void* stream);
void rotate_cuda(const void* x, int dtype, int64_t n, int64_t block, float* out, int device,
                 void* stream);
void unrotate_cuda(const float* y, int64_t n, int64_t block, uint64_t seed, int dtype, void* out,
                   int device, void* stream);

}  // namespace gact
