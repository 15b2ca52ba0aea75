// pybind11 module gact_kernels._cuda: integer addresses, sizes, device index and cudaStream_t.
// Compiled by the host compiler; the kernels live in cuda.cu and cuda_ints.cu.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "kernels.h"

namespace py = pybind11;
using gact::ptr;

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "gact-kernels CUDA kernels (asynchronous on the given stream).";
  using Release = py::call_guard<py::gil_scoped_release>;
  m.def(
      "quantize",
      [](uintptr_t x, int dtype, int64_t n, int64_t group_size, int bits, uint64_t seed,
         bool zero_exact, uintptr_t out, uintptr_t lo, uintptr_t scale, uintptr_t lossless_flag,
         int device, uintptr_t stream) {
        gact::quantize_cuda(ptr<const void>(x), dtype, n, group_size, bits, seed, zero_exact,
                            ptr<uint8_t>(out), ptr<float>(lo), ptr<float>(scale),
                            ptr<uint8_t>(lossless_flag), device, ptr<void>(stream));
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"), py::arg("bits"),
      py::arg("seed"), py::arg("zero_exact"), py::arg("out"), py::arg("lo"), py::arg("scale"),
      py::arg("lossless_flag"), py::arg("device"), py::arg("stream"), Release());
  m.def(
      "device_addressable",
      [](uintptr_t host) { return gact::device_addressable(ptr<const void>(host)); },
      py::arg("host"));
  m.def(
      "dequantize",
      [](uintptr_t data, uintptr_t lo, uintptr_t scale, int64_t n, int64_t group_size, int bits,
         uint64_t seed, bool zero_exact, int dtype, uintptr_t out, int device, uintptr_t stream) {
        gact::dequantize_cuda(ptr<const uint8_t>(data), ptr<const float>(lo),
                              ptr<const float>(scale), n, group_size, bits, seed, zero_exact,
                              dtype, ptr<void>(out), device, ptr<void>(stream));
      },
      py::arg("data"), py::arg("lo"), py::arg("scale"), py::arg("n"), py::arg("group_size"),
      py::arg("bits"), py::arg("seed"), py::arg("zero_exact"), py::arg("dtype"), py::arg("out"),
      py::arg("device"), py::arg("stream"), Release());
  m.def(
      "rotate",
      [](uintptr_t x, int dtype, int64_t n, int64_t block, uintptr_t out, int device,
         uintptr_t stream) {
        gact::rotate_cuda(ptr<const void>(x), dtype, n, block, ptr<float>(out), device,
                          ptr<void>(stream));
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("block"), py::arg("out"),
      py::arg("device"), py::arg("stream"), Release());
  m.def(
      "unrotate",
      [](uintptr_t y, int64_t n, int64_t block, uint64_t seed, int dtype, uintptr_t out,
         int device, uintptr_t stream) {
        gact::unrotate_cuda(ptr<const float>(y), n, block, seed, dtype, ptr<void>(out), device,
                            ptr<void>(stream));
      },
      py::arg("y"), py::arg("n"), py::arg("block"), py::arg("seed"), py::arg("dtype"),
      py::arg("out"), py::arg("device"), py::arg("stream"), Release());
  m.def(
      "bucketize",
      [](uintptr_t x, int dtype, int64_t n, uintptr_t bounds, int nb, uintptr_t out, int device,
         uintptr_t stream) {
        gact::bucketize_cuda(ptr<const void>(x), dtype, n, ptr<const float>(bounds), nb,
                             ptr<uint8_t>(out), device, ptr<void>(stream));
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("bounds"), py::arg("nb"),
      py::arg("out"), py::arg("device"), py::arg("stream"), Release());
  m.def(
      "pack_mask",
      [](uintptr_t in, int64_t n, uintptr_t out, int device, uintptr_t stream) {
        gact::pack_mask_cuda(ptr<const uint8_t>(in), n, ptr<uint8_t>(out), device,
                             ptr<void>(stream));
      },
      py::arg("mask"), py::arg("n"), py::arg("out"), py::arg("device"), py::arg("stream"),
      Release());
  m.def(
      "unpack_mask",
      [](uintptr_t in, int64_t n, uintptr_t out, int device, uintptr_t stream) {
        gact::unpack_mask_cuda(ptr<const uint8_t>(in), n, ptr<uint8_t>(out), device,
                               ptr<void>(stream));
      },
      py::arg("packed"), py::arg("n"), py::arg("out"), py::arg("device"), py::arg("stream"),
      Release());
  m.def(
      "int_params",
      [](uintptr_t x, int dtype, int64_t n, int64_t group_size, uintptr_t mins, uintptr_t widths,
         int device, uintptr_t stream) {
        gact::int_params_cuda(ptr<const void>(x), dtype, n, group_size, ptr<int64_t>(mins),
                              ptr<uint8_t>(widths), device, ptr<void>(stream));
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"), py::arg("mins"),
      py::arg("widths"), py::arg("device"), py::arg("stream"), Release());
  m.def(
      "pack_ints",
      [](uintptr_t x, int dtype, int64_t n, int64_t group_size, uintptr_t mins, uintptr_t widths,
         uintptr_t starts, uintptr_t out, int device, uintptr_t stream) {
        gact::pack_ints_cuda(ptr<const void>(x), dtype, n, group_size, ptr<const int64_t>(mins),
                             ptr<const uint8_t>(widths), ptr<const int64_t>(starts),
                             ptr<uint8_t>(out), device, ptr<void>(stream));
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"), py::arg("mins"),
      py::arg("widths"), py::arg("starts"), py::arg("out"), py::arg("device"), py::arg("stream"),
      Release());
  m.def(
      "unpack_ints",
      [](uintptr_t data, int64_t data_bytes, uintptr_t mins, uintptr_t widths, uintptr_t starts,
         int64_t n, int64_t group_size, int dtype, uintptr_t out, int device, uintptr_t stream) {
        gact::unpack_ints_cuda(ptr<const uint8_t>(data), data_bytes, ptr<const int64_t>(mins),
                               ptr<const uint8_t>(widths), ptr<const int64_t>(starts), n,
                               group_size, dtype, ptr<void>(out), device, ptr<void>(stream));
      },
      py::arg("data"), py::arg("data_bytes"), py::arg("mins"), py::arg("widths"),
      py::arg("starts"), py::arg("n"), py::arg("group_size"), py::arg("dtype"), py::arg("out"),
      py::arg("device"), py::arg("stream"), Release());
}
