// pybind11 module gact_kernels._cpu: integer addresses and sizes in, nothing torch-specific.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "kernels.h"

namespace py = pybind11;
using gact::ptr;

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "gact-kernels CPU kernels (OpenMP). Use the gact_kernels package, not this module.";
  using Release = py::call_guard<py::gil_scoped_release>;
  m.def(
      "quantize",
      [](uintptr_t x, int dtype, int64_t n, int64_t group_size, int bits, uint64_t seed,
         bool zero_exact, uintptr_t out, uintptr_t lo, uintptr_t scale, int threads) {
        return gact::quantize_cpu(ptr<const void>(x), dtype, n, group_size, bits, seed,
                                  zero_exact, ptr<uint8_t>(out), ptr<float>(lo),
                                  ptr<float>(scale), threads);
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"), py::arg("bits"),
      py::arg("seed"), py::arg("zero_exact"), py::arg("out"), py::arg("lo"), py::arg("scale"),
      py::arg("threads"), Release());
  m.def(
      "dequantize",
      [](uintptr_t data, uintptr_t lo, uintptr_t scale, int64_t n, int64_t group_size, int bits,
         uint64_t seed, bool zero_exact, int dtype, uintptr_t out, int threads) {
        gact::dequantize_cpu(ptr<const uint8_t>(data), ptr<const float>(lo),
                             ptr<const float>(scale), n, group_size, bits, seed, zero_exact,
                             dtype, ptr<void>(out), threads);
      },
      py::arg("data"), py::arg("lo"), py::arg("scale"), py::arg("n"), py::arg("group_size"),
      py::arg("bits"), py::arg("seed"), py::arg("zero_exact"), py::arg("dtype"), py::arg("out"),
      py::arg("threads"), Release());
  m.def("vbmi_supported", &gact::vbmi_supported_cpu,
        "Whether this CPU packs odd widths with AVX-512 VBMI byte permutes.");
  m.def("use_vbmi", &gact::use_vbmi_cpu, py::arg("on"),
        "Takes the VBMI packing path (on) or the portable one; returns the previous setting. "
        "Both write the same bytes: tests switch between them.");
  m.def(
      "quantize_runs",
      [](uintptr_t x, int dtype, int64_t outer, int64_t channels, int64_t inner, int64_t run,
         int64_t group_size, int bits, uint64_t seed, bool zero_exact, uintptr_t out, uintptr_t lo,
         uintptr_t scale, int threads) {
        return gact::quantize_runs_cpu(ptr<const void>(x), dtype, outer, channels, inner, run,
                                       group_size, bits, seed, zero_exact, ptr<uint8_t>(out),
                                       ptr<float>(lo), ptr<float>(scale), threads);
      },
      py::arg("x"), py::arg("dtype"), py::arg("outer"), py::arg("channels"), py::arg("inner"),
      py::arg("run"), py::arg("group_size"), py::arg("bits"), py::arg("seed"),
      py::arg("zero_exact"), py::arg("out"), py::arg("lo"), py::arg("scale"), py::arg("threads"),
      Release());
  m.def(
      "dequantize_runs",
      [](uintptr_t data, uintptr_t lo, uintptr_t scale, int64_t outer, int64_t channels,
         int64_t inner, int64_t run, int64_t group_size, int bits, uint64_t seed, bool zero_exact,
         int dtype, uintptr_t out, int threads) {
        gact::dequantize_runs_cpu(ptr<const uint8_t>(data), ptr<const float>(lo),
                                  ptr<const float>(scale), outer, channels, inner, run,
                                  group_size, bits, seed, zero_exact, dtype, ptr<void>(out),
                                  threads);
      },
      py::arg("data"), py::arg("lo"), py::arg("scale"), py::arg("outer"), py::arg("channels"),
      py::arg("inner"), py::arg("run"), py::arg("group_size"), py::arg("bits"), py::arg("seed"),
      py::arg("zero_exact"), py::arg("dtype"), py::arg("out"), py::arg("threads"), Release());
  m.def(
      "rotate",
      [](uintptr_t x, int dtype, int64_t n, int64_t block, uintptr_t out, int threads) {
        gact::rotate_cpu(ptr<const void>(x), dtype, n, block, ptr<float>(out), threads);
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("block"), py::arg("out"),
      py::arg("threads"), Release());
  m.def(
      "unrotate",
      [](uintptr_t y, int64_t n, int64_t block, uint64_t seed, int dtype, uintptr_t out,
         int threads) {
        gact::unrotate_cpu(ptr<const float>(y), n, block, seed, dtype, ptr<void>(out), threads);
      },
      py::arg("y"), py::arg("n"), py::arg("block"), py::arg("seed"), py::arg("dtype"),
      py::arg("out"), py::arg("threads"), Release());
  m.def(
      "bucketize",
      [](uintptr_t x, int dtype, int64_t n, uintptr_t bounds, int nb, uintptr_t out, int threads) {
        gact::bucketize_cpu(ptr<const void>(x), dtype, n, ptr<const float>(bounds), nb,
                            ptr<uint8_t>(out), threads);
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("bounds"), py::arg("nb"),
      py::arg("out"), py::arg("threads"), Release());
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
  m.def(
      "int_params",
      [](uintptr_t x, int dtype, int64_t n, int64_t group_size, uintptr_t mins, uintptr_t widths,
         int threads) {
        gact::int_params_cpu(ptr<const void>(x), dtype, n, group_size, ptr<int64_t>(mins),
                             ptr<uint8_t>(widths), threads);
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"), py::arg("mins"),
      py::arg("widths"), py::arg("threads"), Release());
  m.def(
      "pack_ints",
      [](uintptr_t x, int dtype, int64_t n, int64_t group_size, uintptr_t mins, uintptr_t widths,
         uintptr_t starts, uintptr_t out, int threads) {
        gact::pack_ints_cpu(ptr<const void>(x), dtype, n, group_size, ptr<const int64_t>(mins),
                            ptr<const uint8_t>(widths), ptr<const int64_t>(starts),
                            ptr<uint8_t>(out), threads);
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"), py::arg("mins"),
      py::arg("widths"), py::arg("starts"), py::arg("out"), py::arg("threads"), Release());
  m.def(
      "unpack_ints",
      [](uintptr_t data, int64_t data_bytes, uintptr_t mins, uintptr_t widths, uintptr_t starts,
         int64_t n, int64_t group_size, int dtype, uintptr_t out, int threads) {
        gact::unpack_ints_cpu(ptr<const uint8_t>(data), data_bytes, ptr<const int64_t>(mins),
                              ptr<const uint8_t>(widths), ptr<const int64_t>(starts), n,
                              group_size, dtype, ptr<void>(out), threads);
      },
      py::arg("data"), py::arg("data_bytes"), py::arg("mins"), py::arg("widths"),
      py::arg("starts"), py::arg("n"), py::arg("group_size"), py::arg("dtype"), py::arg("out"),
      py::arg("threads"), Release());
}
