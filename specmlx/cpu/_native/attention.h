// The MLX op and primitive: scaled dot-product attention for float32 decode and verify
// shapes on the CPU, out = softmax(q k^T scale + mask) v.
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// Head sizes the kernel takes: a multiple of kHeadDimStep up to kMaxHeadDim.
constexpr int kHeadDimStep = 16;
constexpr int kMaxHeadDim = 512;

// q: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D), all float32, Hq a multiple of Hkv (GQA).
// causal: query row i sees keys 0 .. Lk - Lq + i (needs Lq <= Lk); otherwise every key.
// k and v may be strided views (a KV cache's `[..., :offset, :]`): read in place. Each
// query row's result depends on that row, its keys and values alone, bit for bit: not on
// Lq, the rows beside it or the thread count. Returns (B, Hq, Lq, D). CPU streams only.
mx::array scaled_dot_product_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    mx::StreamOrDevice s = {});

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SpecmlxAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_;
};

} // namespace specmlx
