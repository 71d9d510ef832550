// Reading an input through its strides, so that an op takes views as they are: an
// mx::contiguous node in front of every call costs MLX's per-op dispatch even when it
// copies nothing, and an input is rarely evaluated (its layout known) when the graph is built.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

namespace specmlx {

// x's elements (of T's size) in row-major order: x's own buffer when it is row-contiguous,
// else a copy gathered through its strides into scratch. For use inside an op's task, where
// x's layout is known.
template <typename T>
const T* row_major(const mlx::core::array& x, std::vector<T>& scratch) {
  if (x.flags().row_contiguous) {
    return x.data<T>();
  }
  scratch.resize(x.size());
  const T* src = static_cast<const T*>(x.data<void>());
  // One run along the last axis per index of the others (odometer order over them).
  const int nd = x.ndim(), last = x.shape(nd - 1);
  const int64_t step = x.strides(nd - 1);
  std::vector<int> index(nd - 1, 0);
  for (size_t row = 0; row * last < x.size(); ++row) {
    int64_t at = 0;
    for (int d = 0; d < nd - 1; ++d) {
      at += int64_t(index[d]) * int64_t(x.strides(d));
    }
    T* dst = scratch.data() + row * last;
    for (int i = 0; i < last; ++i) {
      dst[i] = src[at + i * step];
    }
    for (int d = nd - 2; d >= 0 && ++index[d] == x.shape(d); --d) {
      index[d] = 0;
    }
  }
  return scratch.data();
}

// x as a row-contiguous input of an op being built: itself when it already is one (a
// weight: evaluated, and row-contiguous as stored), else mx::contiguous of it. A lazy
// array's layout is not known yet, so it gets the node; mx::contiguous adds one even for
// an array that needs no copy, and a node costs MLX's per-op dispatch (three per linear
// layer were ~600 in a 1.5B decode step). Inputs that are mostly lazy (x, ids) are better
// read with row_major in the task.
inline mlx::core::array row_contiguous(const mlx::core::array& x, mlx::core::Stream s) {
  if (x.is_available() && x.flags().row_contiguous) {
    return x;
  }
  return mlx::core::contiguous(x, false, s);
}

} // namespace specmlx
