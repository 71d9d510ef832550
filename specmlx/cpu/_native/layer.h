// The MLX op and primitive: one step of a pre-norm decoder layer (mlx-lm's plain block, as
// Llama and Qwen2 have it) on a plain KV cache, as one op on the CPU.
#pragma once

#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// x (B, L, hidden) float32, through
//   h   = x + o(cached_attention(q(n), k(n), v(n)))  with n = rms_norm(x, norm_in)
//   out = h + down(act(gate(m)) * up(m))              with m = rms_norm(h, norm_post)
// where q, k, v, o, gate, up and down are (w, scales, biases) triples of one group size and
// bits (qkv: 9 arrays, and a bias for each or none; o, down: 3; gate_up: 6), act silu or
// gelu_approx, and the attention is cached_attention's (RoPE, the new positions written at
// offset .. offset + L - 1 of the (B, Hkv, S, D) caches, `reuse` as there). Returns (out,
// the new k_cache, the new v_cache). Each step runs the arithmetic of its own op on the same
// values, so every output bit equals that of rms_norm, stacked_matmul, cached_attention,
// quantized_matmul, the add, rms_norm, gated_matmul, quantized_matmul and the add run one
// after another: one graph node where those are nine. `packed`: pack_quad's layout of q, k,
// v, o, gate, up and down (7), or none, as those ops take it.
std::vector<mx::array> decoder_layer(
    const mx::array& x,
    const mx::array& norm_in,
    float eps_in,
    const std::vector<mx::array>& qkv,
    const std::vector<mx::array>& qkv_bias,
    const std::vector<mx::array>& o,
    const mx::array& norm_post,
    float eps_post,
    const std::vector<mx::array>& gate_up,
    const std::vector<mx::array>& down,
    const mx::array& k_cache,
    const mx::array& v_cache,
    int group_size,
    int bits,
    const std::string& activation,
    int n_heads,
    int offset,
    int rope_dims,
    bool rope_traditional,
    float rope_base,
    float rope_scale,
    float scale,
    bool causal,
    bool reuse,
    const std::vector<mx::array>& packed = {},
    mx::StreamOrDevice s = {});

// Inputs: x, norm_in, norm_post, q k v (9), o (3), gate up (6), down (3), k_cache,
// v_cache, then the q, k and v biases if any, then the 7 packed matrices if any. Outputs:
// out, k_cache, v_cache.
class DecoderLayer : public mx::Primitive {
 public:
  struct Settings {
    float eps_in, eps_post;
    int group_size, bits;
    int act;  // a GateAct
    int n_heads, offset, rope_dims;
    bool rope_traditional;
    float rope_base, rope_scale, scale;
    bool causal, reuse, biased, packed;
    bool operator==(const Settings&) const = default;
  };

  DecoderLayer(mx::Stream stream, const Settings& settings) : mx::Primitive(stream), s_(settings) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "SpecmlxDecoderLayer";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return s_ == static_cast<const DecoderLayer&>(other).s_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[24].shape(), inputs[25].shape()};
  }

 private:
  Settings s_;
};

} // namespace specmlx
