// The MLX op and primitive: rotary position embedding (mx.fast.rope's math) on the CPU.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// Rows of x (B, H, T, D), read through its strides, rotated into out through its own (both
// in floats; out's D axis contiguous), row t at position offset + t: the arithmetic of the
// rope op, for ops that place its rows elsewhere (a KV cache's slots).
struct RopeJob {
  const float* x;
  int64_t stride_b, stride_h, stride_t, stride_d;
  float* out;
  int64_t out_b, out_h, out_t;
  int B, H, T, D;
  int dims;
  bool traditional;
  float base, scale;
  int offset;
};

void rope_rows(const RopeJob& job);

// x: (B, H, T, D) float32, any strides; offset: an int32 scalar
// (the position of row t = 0). Rotates the first `dims` features of each row by angles
// (offset + t) * scale * base^(-2i/dims), pairs (i, i + dims/2), or (2i, 2i + 1) when
// traditional; the rest pass through. Returns a row-contiguous float32 (B, H, T, D).
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    mx::StreamOrDevice s = {});

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SpecmlxRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

} // namespace specmlx
