// The MLX op and primitive: softmax over the last axis of a float32 array, on the CPU.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// x: (..., V) float32. Returns softmax(x) along the last axis, float32. A -inf entry (a
// token masked out by top-k or top-p) gets exactly 0. CPU streams only.
mx::array softmax(const mx::array& x, mx::StreamOrDevice s = {});

class Softmax : public mx::UnaryPrimitive {
 public:
  explicit Softmax(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SpecmlxSoftmax";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

} // namespace specmlx
