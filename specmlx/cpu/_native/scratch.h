// Per-thread scratch buffers for the ops' tasks.
#pragma once

#include <cstddef>
#include <memory>

namespace specmlx {

// `buf` (holding `cap` Ts) with room for n, grown only when n is more: held thread_local by
// a caller, it is allocated once, where a fresh buffer per call (prefill-sized copies of x,
// attention's scores) would page-fault new memory every time.
template <typename T>
T* scratch(std::unique_ptr<T[]>& buf, size_t& cap, size_t n) {
  if (n > cap) {
    buf.reset(new T[n]);
    cap = n;
  }
  return buf.get();
}

} // namespace specmlx
