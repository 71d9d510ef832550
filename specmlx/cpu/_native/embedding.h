// The MLX op and primitive: rows of an MLX-quantized (affine) table, dequantized, on the CPU.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// ids: integer array (any shape); w (V, K * bits / 32) uint32, scales and biases (V, K /
// group_size) of one float type: MLX's affine layout, 4, 6 or 8 bits. Returns the float32
// rows (ids.shape..., K), each value scale * q + bias in float32, the scale and bias
// widened exactly first: the bits of mx.dequantize over the gathered rows with their
// scales and biases cast to float32 (a quantized embedding's lookup).
mx::array quantized_rows(
    const mx::array& ids,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SpecmlxQuantizedRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedRows&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
};

} // namespace specmlx
