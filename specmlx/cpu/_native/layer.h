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

// The same step for R sequences at once, each on its own cache: x (R, W, hidden) holds row
// r's lengths[r] new tokens first (the rest is padding: it reaches no cache, and its output
// rows are zeros), k_caches[r] and v_caches[r] are (1, Hkv, S_r, D) with row r's new
// positions at offsets[r] ... The products run over all R * W rows at once; each row's
// attention runs on its own cache as decoder_layer's would with that row alone (causal[r]:
// its mask, reuse[r] as there), so each row's output bits are those of its own pass.
// Returns (out, the R new k caches, the R new v caches). With one cache, it is decoder_layer:
// a cache of x's batch, every row's L positions new.
std::vector<mx::array> decoder_layer_rows(
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
    const std::vector<mx::array>& k_caches,
    const std::vector<mx::array>& v_caches,
    int group_size,
    int bits,
    const std::string& activation,
    int n_heads,
    const std::vector<int>& offsets,
    const std::vector<int>& lengths,
    int rope_dims,
    bool rope_traditional,
    float rope_base,
    float rope_scale,
    float scale,
    const std::vector<int>& causal,
    const std::vector<int>& reuse,
    const std::vector<mx::array>& packed = {},
    mx::StreamOrDevice s = {});

// Inputs: x, norm_in, norm_post, q k v (9), o (3), gate up (6), down (3), the C k caches,
// the C v caches, then the q, k and v biases if any, then the 7 packed matrices if any.
// Outputs: out, the C k caches, the C v caches. C = 1: one cache of x's batch (a sequence's
// pass, decoder_layer); C > 1: a cache per row of x (decoder_layer_rows).
class DecoderLayer : public mx::Primitive {
 public:
  struct Settings {
    float eps_in, eps_post;
    int group_size, bits;
    int act;  // a GateAct
    int n_heads, rope_dims;
    bool rope_traditional;
    float rope_base, rope_scale, scale;
    bool biased, packed;
    // Per cache: where its new positions start, how many there are (rows mode; a
    // sequence's pass: x's length), whether they attend causally, whether its buffer may
    // be written in place.
    std::vector<int> offsets, lengths, causal, reuse;
    bool operator==(const Settings&) const = default;
  };

  DecoderLayer(mx::Stream stream, Settings settings) : mx::Primitive(stream), s_(std::move(settings)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "SpecmlxDecoderLayer";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return s_ == static_cast<const DecoderLayer&>(other).s_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes{inputs[0].shape()};
    for (size_t c = 0; c < 2 * s_.offsets.size(); ++c) {
      shapes.push_back(inputs[24 + c].shape());
    }
    return shapes;
  }

 private:
  Settings s_;
};

} // namespace specmlx
