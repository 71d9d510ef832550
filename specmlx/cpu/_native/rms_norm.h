// The MLX op and primitive: RMSNorm (mx.fast.rms_norm's math) over float32 rows, on the CPU.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// x: (..., D) float32, any layout; weight: (D,) float32. Returns, row-contiguous,
// weight * x * rsqrt(mean(x^2) + eps) along the last axis.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

// The op's arithmetic on row-major buffers: `rows` rows of n floats, x to y.
void rms_norm_rows(const float* x, const float* w, float* y, size_t rows, int n, float eps);

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SpecmlxRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

} // namespace specmlx
