// pybind11 module gact_kernels._cpu: integer addresses and sizes in, nothing torch-specific.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;

namespace {
template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}
}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "gact-kernels CPU kernels (OpenMP). Use the gact_kernels package, not this module.";
  using Release = py::call_guard<py::gil_scoped_release>;
  m.def(
      "quantize",
      [](uintptr_t x, int dtype, int64_t n, int64_t group_size, int bits, uint64_t seed,
         uintptr_t out, uintptr_t lo, uintptr_t scale, int threads) {
        gact::quantize_cpu(ptr<const void>(x), dtype, n, group_size, bits, seed, ptr<uint8_t>(out),
                           ptr<float>(lo), ptr<float>(scale), threads);
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"), py::arg("bits"),
      py::arg("seed"), py::arg("out"), py::arg("lo"), py::arg("scale"), py::arg("threads"),
      Release());
  m.def(
      "dequantize",
      [](uintptr_t data, uintptr_t lo, uintptr_t scale, int64_t n, int64_t group_size, int bits,
         int dtype, uintptr_t out, int threads) {
        gact::dequantize_cpu(ptr<const uint8_t>(data), ptr<const float>(lo),
                             ptr<const float>(scale), n, group_size, bits, dtype, ptr<void>(out),
                             threads);
      },
      py::arg("data"), py::arg("lo"), py::arg("scale"), py::arg("n"), py::arg("group_size"),
      py::arg("bits"), py::arg("dtype"), py::arg("out"), py::arg("threads"), Release());
  m.def(
      "pack_mask",
      [](uintptr_t in, int64_t n, uintptr_t out, int threads) {
        return gact::pack_mask_cpu(ptr<const uint8_t>(in), n, ptr<uint8_t>(out), threads);
      },
      py::arg("mask"), py::arg("n"), py::arg("out"), py::arg("threads"), Release());
  m.def(
      "unpack_mask",
      [](uintptr_t in, int64_t n, uintptr_t out, int threads) {
        gact::unpack_mask_cpu(ptr<const uint8_t>(in), n, ptr<uint8_t>(out), threads);
      },
      py::arg("packed"), py::arg("n"), py::arg("out"), py::arg("threads"), Release());
}
