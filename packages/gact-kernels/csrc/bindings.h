// Shared by the two pybind11 modules: addresses cross the boundary as Python ints.
#pragma once

#include <cstdint>

namespace gact {

// The pointer behind an address handed over by the Python wrapper (Tensor.data_ptr()).
template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace gact
