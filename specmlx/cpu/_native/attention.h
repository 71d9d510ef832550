// The MLX op and primitive: scaled dot-product attention for float32 decode and verify
// shapes on the CPU, out = softmax(q k^T scale + mask) v.
#pragma once

#include <optional>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace specmlx {

namespace mx = mlx::core;

// Head sizes the kernel takes: a multiple of kHeadDimStep up to kMaxHeadDim.
constexpr int kHeadDimStep = 16;
constexpr int kMaxHeadDim = 512;

// q: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D), all float32, Hq a multiple of Hkv (GQA).
// Positions: key slot j holds position key_start + (j - rotation) mod Lk (a sliding
// window's ring buffer hands its keys rotated; a plain cache has key_start = rotation = 0)
// and query row i is position key_start + Lk - Lq + i (the newest ones). causal: row i
// sees the keys at positions up to its own, and with window > 0 only those above its
// position - window; otherwise every key. A row's keys are taken in position order
// whatever slots they sit in. sinks (Hq,), optional: a per-head logit that joins the
// softmax's denominator only. k and v may be strided views (a KV cache's
// `[..., :offset, :]`): read in place. Each query row's result depends on that row, its
// positions, keys and values alone, bit for bit: not on Lq, the rows beside it, the slots
// its keys sit in or the thread count. mask (Lq, Lk) bool, optional: row i also leaves
// out the key in slot j wherever mask[i, j] is false (a tree's rows, each reading the
// context and its own ancestors; with causal, no row reads past its own position), its
// bits those of the chain of its ancestors run alone.
// Returns (B, Hq, Lq, D). CPU streams only.
mx::array scaled_dot_product_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    const std::optional<mx::array>& sinks = std::nullopt,
    int window = 0,
    int64_t key_start = 0,
    int rotation = 0,
    const std::optional<mx::array>& mask = std::nullopt,
    mx::StreamOrDevice s = {});

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal, int window, int64_t key_start, int rotation, bool has_mask)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        causal_(causal),
        window_(window),
        key_start_(key_start),
        rotation_(rotation),
        has_mask_(has_mask) {}

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
  int window_;
  int64_t key_start_;
  int rotation_;
  bool has_mask_;  // the last input
};

// One attention layer's step on a plain KV cache (mlx-lm's KVCache, with room for L more
// positions), as one op: RoPE of q and k, k and v written into the cache's buffers at
// positions offset .. offset + L - 1, and attention of the L query rows over positions
// 0 .. offset + L - 1 (causal over the new ones). q (B, L, Hq*D), k and v (B, L, Hkv*D):
// the projections as they come; k_cache, v_cache (B, Hkv, S, D). Returns (out (B, L, Hq*D),
// the new k_cache, the new v_cache). With `reuse` (the caller holds the caches' arrays in
// one place, which it rebinds to the new ones) the new caches are the old buffers, written
// in place, where nothing else holds them when the op is queued (no view, no pending task),
// as MLX's donation gives a slice update its input; otherwise copies. Every output bit
// equals that of the rope op, the cache's slice updates and the attention op above, run
// one after another.
std::vector<mx::array> cached_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& k_cache,
    const mx::array& v_cache,
    int n_heads,
    int offset,
    int rope_dims,
    bool rope_traditional,
    float rope_base,
    float rope_scale,
    float scale,
    bool causal,
    bool reuse,
    mx::StreamOrDevice s = {});

// The arithmetic of cached_attention on buffers, for ops that run it as one of their steps:
// q (B, L, Hq*D), k and v (B, L, Hkv*D) row-major; the caches' (B, Hkv, S, D) buffers take
// the new positions offset .. offset + L - 1; out is (B, L, Hq*D).
struct CachedJob {
  const float* q;
  const float* k;
  const float* v;
  float* k_cache;
  float* v_cache;
  float* out;
  int B, L, Hq, Hkv, S, D, offset;
  int rope_dims;
  bool rope_traditional;
  float rope_base, rope_scale;
  float scale;
  bool causal;
};
void cached_attention_rows(const CachedJob& job);

// The cache buffer an op's output takes: the input's own memory where `reuse` (the caller
// knows of no other holder of the array) and the buffer is held by no view and no pending
// task (returns false), else a fresh one (returns true: the task must fill it with
// copy_cache). MLX's own test, is_donatable, cannot pass here: each output of a
// multi-output node keeps its own copy of the inputs.
bool take_cache_buffer(const mx::array& in, mx::array& out, bool reuse);
void copy_cache(const mx::array& in, float* out);

class CachedAttention : public mx::Primitive {
 public:
  CachedAttention(
      mx::Stream stream,
      int n_heads,
      int offset,
      int rope_dims,
      bool rope_traditional,
      float rope_base,
      float rope_scale,
      float scale,
      bool causal,
      bool reuse)
      : mx::Primitive(stream),
        n_heads_(n_heads),
        offset_(offset),
        rope_dims_(rope_dims),
        rope_traditional_(rope_traditional),
        rope_base_(rope_base),
        rope_scale_(rope_scale),
        scale_(scale),
        causal_(causal),
        reuse_(reuse) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "SpecmlxCachedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[3].shape(), inputs[4].shape()};
  }

 private:
  int n_heads_;
  int offset_;
  int rope_dims_;
  bool rope_traditional_;
  float rope_base_;
  float rope_scale_;
  float scale_;
  bool causal_;
  bool reuse_;
};

} // namespace specmlx
