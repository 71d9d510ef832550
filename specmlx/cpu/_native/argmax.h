// The MLX op and primitive: the argmax of each float32 row's first n entries, on the CPU.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// x: (..., V) float32; 0 < n <= V. Returns uint32 (...,): the index of each row's largest
// of x[0 .. n - 1], the first where several tie, as mx.argmax(x[..., :n], axis=-1) gives it
// (a NaN counts above every number: the first NaN wins). CPU streams only.
mx::array argmax(const mx::array& x, int n, mx::StreamOrDevice s = {});

class Argmax : public mx::UnaryPrimitive {
 public:
  Argmax(mx::Stream stream, int n) : mx::UnaryPrimitive(stream), n_(n) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SpecmlxArgmax";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return n_ == static_cast<const Argmax&>(other).n_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.pop_back();
    return {shape};
  }

 private:
  int n_;
};

} // namespace specmlx
