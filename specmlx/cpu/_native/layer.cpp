// A decoder layer's step as one op. A 1.5B decode step was ~9 graph nodes a layer (two
// norms, the stacked q/k/v product, the cached attention, o, the gated product, down and
// two adds), and each node costs the Python thread and MLX's dispatch the same whatever its
// size (bench/results/ARCHIVE.md, "a decoder layer as one op"). Here the layer's steps run
// back to back in one task, each through the function its own op's task calls
// (rms_norm_rows, run_stacked, cached_attention_rows, run_matmul), on scratch buffers, so
// the result is theirs bit for bit and rows stay independent of each other as they are
// there.
#include "layer.h"

#include <memory>
#include <optional>
#include <stdexcept>

#include "attention.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"
#include "rms_norm.h"
#include "scratch.h"
#include "strided.h"

namespace specmlx {
namespace {

// Indices of DecoderLayer's inputs.
// The caches start at kCaches: C k caches, then C v caches; the biases follow them.
constexpr int kX = 0, kNormIn = 1, kNormPost = 2, kQ = 3, kK = 6, kV = 9, kO = 12, kGate = 15, kUp = 18,
              kDown = 21, kCaches = 24;

// Matrix (w, scales, biases) at input i, and its packed layout at input p (p < 0: none).
MatmulWeights weights_at(const std::vector<mx::array>& in, int i, int p) {
  return {in[i].data<uint32_t>(), in[i + 1].data<void>(), in[i + 2].data<void>(),
          p < 0 ? nullptr : in[p].data<uint8_t>()};
}

// A float32 product of row-major float32 x (M rows of K) into out.
MatmulCall matmul_call(const float* x, MatmulWeights a, MatmulWeights b, GateAct act, ScaleType t, float* out,
                       int M, int N, int K, int group_size, int bits) {
  return {x, mx::float32, a, b, nullptr, act, t, out, mx::float32, M, N, K, group_size, bits};
}

void add_rows(const float* a, const float* b, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    out[i] = a[i] + b[i];
  }
}

void check(bool ok, const char* what) {
  if (!ok) {
    throw std::invalid_argument(std::string("[specmlx] decoder_layer: ") + what);
  }
}

// (w, scales, biases) of an N x K matrix at these settings, scales and biases of one type.
void check_matrix(const mx::array* t, int N, int K, int group_size, int bits) {
  check(t[0].dtype() == mx::uint32 && t[0].shape() == mx::Shape{N, K * bits / 32}, "a weight's shape does not fit");
  const mx::Shape groups{N, K / group_size};
  check(t[1].shape() == groups && t[2].shape() == groups && t[1].dtype() == t[2].dtype(),
        "scales and biases must be (N, K/group_size) of one type");
  check(t[1].dtype() == mx::float32 || t[1].dtype() == mx::float16 || t[1].dtype() == mx::bfloat16,
        "scales must be float32, float16 or bfloat16");
}

} // namespace

void DecoderLayer::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[kX];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int C = int(s_.offsets.size());
  // A cache the task copies from is held by the task; one taken in place is not (a
  // reference would keep the next step from taking its buffer while this task waits).
  std::vector<std::optional<mx::array>> from(2 * C);
  for (int c = 0; c < 2 * C; ++c) {
    if (take_cache_buffer(inputs[kCaches + c], outputs[1 + c], s_.reuse[c % C])) {
      from[c] = inputs[kCaches + c];
    }
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  const auto& kc = inputs[kCaches];
  const int B = x.shape(0), L = x.shape(1), hidden = x.shape(2), M = B * L;
  const int Hkv = kc.shape(1), D = kc.shape(3), Hq = s_.n_heads;
  const int kv = Hkv * D, qd = Hq * D, I = inputs[kGate].shape(0);
  const int gs = s_.group_size, bits = s_.bits;
  const GateAct act = GateAct(s_.act);
  const auto type_at = [&](int i) { return scale_type(inputs[i + 1].dtype()); };
  const float* norm_in = inputs[kNormIn].data<float>();
  const float* norm_post = inputs[kNormPost].data<float>();
  const int kBias = kCaches + 2 * C;
  // The packed matrices follow the biases, in the order of the triples: matrix m at kPacked + m.
  const int kPacked = kBias + (s_.biased ? 3 : 0);
  const auto packed_at = [&](int i) { return s_.packed ? kPacked + (i - kQ) / 3 : -1; };
  std::vector<MatmulProduct> qkv;
  for (int i : {kQ, kK, kV}) {
    const int at = (i - kQ) / 3;
    qkv.push_back({weights_at(inputs, i, packed_at(i)), s_.biased ? inputs[kBias + at].data<void>() : nullptr,
                   nullptr, inputs[i].shape(0)});
  }
  const MatmulWeights o = weights_at(inputs, kO, packed_at(kO)), gate = weights_at(inputs, kGate, packed_at(kGate)),
                      up = weights_at(inputs, kUp, packed_at(kUp)), down = weights_at(inputs, kDown, packed_at(kDown));
  const ScaleType t_qkv = type_at(kQ), t_o = type_at(kO), t_gate = type_at(kGate), t_down = type_at(kDown);
  // One attention job per cache: over the whole batch of x (one cache), or over row c's
  // first lengths[c] positions (a cache per row); the q, k, v and output pointers are set
  // in the task, from the row its job starts at.
  std::vector<CachedJob> jobs;
  for (int c = 0; c < C; ++c) {
    const auto& cache = inputs[kCaches + c];
    jobs.push_back({nullptr, nullptr, nullptr, outputs[1 + c].data<float>(), outputs[1 + C + c].data<float>(),
                    nullptr, C == 1 ? B : 1, s_.lengths[c], Hq, Hkv, cache.shape(2), D, s_.offsets[c],
                    s_.rope_dims, s_.rope_traditional, s_.rope_base, s_.rope_scale, s_.scale, bool(s_.causal[c])});
  }
  float* out_p = out.data<float>();
  const float eps_in = s_.eps_in, eps_post = s_.eps_post;
  encoder.dispatch([=]() mutable {
    thread_local std::vector<float> x_copy;
    thread_local std::unique_ptr<float[]> buf;
    thread_local size_t cap = 0;
    for (int c = 0; c < 2 * C; ++c) {
      if (from[c]) {
        copy_cache(*from[c], c < C ? jobs[c].k_cache : jobs[c - C].v_cache);
      }
    }
    const float* xs = row_major(x, x_copy);
    // n and m share a buffer (n is dead once q, k and v are made), as do the attention's
    // output and the gated product (dead once o has run).
    const size_t rows = size_t(M);
    float* n = scratch(buf, cap, rows * (hidden + qd + 2 * kv + std::max(qd, I) + hidden));
    float* q = n + rows * hidden;
    float* k = q + rows * qd;
    float* v = k + rows * kv;
    float* a = v + rows * kv;
    float* h = a + rows * std::max(qd, I);
    rms_norm_rows(xs, norm_in, n, rows, hidden, eps_in);
    qkv[0].out = q, qkv[1].out = k, qkv[2].out = v;
    run_stacked(matmul_call(n, {}, {}, act, t_qkv, nullptr, M, 0, hidden, gs, bits), qkv);
    for (int c = 0; c < C; ++c) {
      const size_t first = C == 1 ? 0 : size_t(c) * L;  // the job's first row of x
      auto& job = jobs[c];
      job.q = q + first * qd, job.k = k + first * kv, job.v = v + first * kv, job.out = a + first * qd;
      cached_attention_rows(job);
      if (C > 1 && job.L < L) {  // padding: no row of any cache; its output is zeros
        std::fill(a + (first + job.L) * qd, a + (first + L) * qd, 0.0f);
      }
    }
    run_matmul(matmul_call(a, o, {}, act, t_o, h, M, hidden, qd, gs, bits));
    add_rows(xs, h, h, rows * hidden);
    rms_norm_rows(h, norm_post, n, rows, hidden, eps_post);
    run_matmul(matmul_call(n, gate, up, act, t_gate, a, M, I, hidden, gs, bits));
    run_matmul(matmul_call(a, down, {}, act, t_down, out_p, M, hidden, I, gs, bits));
    add_rows(h, out_p, out_p, rows * hidden);
  });
}

void DecoderLayer::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[specmlx] the native decoder layer has no GPU kernel");
}

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
    const std::vector<mx::array>& packed,
    mx::StreamOrDevice s) {
  const int length = x.ndim() == 3 ? x.shape(1) : 0;  // decoder_layer_rows checks the shape
  return decoder_layer_rows(x, norm_in, eps_in, qkv, qkv_bias, o, norm_post, eps_post, gate_up, down, {k_cache},
                            {v_cache}, group_size, bits, activation, n_heads, {offset}, {length}, rope_dims,
                            rope_traditional, rope_base, rope_scale, scale, {causal}, {reuse}, packed, s);
}

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
    const std::vector<mx::array>& packed,
    mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "runs on CPU streams only");
  check(qkv.size() == 9 && o.size() == 3 && gate_up.size() == 6 && down.size() == 3,
        "takes (w, scales, biases) for q, k, v, o, gate, up and down");
  check(qkv_bias.empty() || qkv_bias.size() == 3, "takes a bias for each of q, k and v or for none");
  check(group_size == 32 || group_size == 64 || group_size == 128, "group_size must be 32, 64 or 128");
  check(bits == 4 || bits == 8, "bits must be 4 or 8");
  check(activation == "silu" || activation == "gelu_approx", "the activation is silu or gelu_approx");
  for (const auto* a : {&x, &norm_in, &norm_post}) {
    check(a->dtype() == mx::float32, "x, the norms' weights and the caches must be float32");
  }
  check(x.ndim() == 3, "takes x (B, L, hidden)");
  const int B = x.shape(0), L = x.shape(1), hidden = x.shape(2);
  const size_t C = k_caches.size();
  check(C > 0 && v_caches.size() == C && offsets.size() == C && lengths.size() == C && causal.size() == C &&
            reuse.size() == C,
        "takes a k cache, a v cache, an offset, a length, a mask and a reuse flag per cache");
  check(C == 1 || int(C) == B, "takes one cache, or one per row of x");
  const int Hkv = k_caches[0].ndim() == 4 ? k_caches[0].shape(1) : 0;
  const int D = k_caches[0].ndim() == 4 ? k_caches[0].shape(3) : 0;
  for (size_t c = 0; c < C; ++c) {
    const auto &kc = k_caches[c], &vc = v_caches[c];
    check(kc.dtype() == mx::float32 && vc.dtype() == mx::float32, "x, the norms' weights and the caches must be float32");
    check(kc.ndim() == 4 && vc.shape() == kc.shape(), "takes caches (B, Hkv, S, D), k and v of one shape");
    check(kc.shape(0) == (C == 1 ? B : 1) && kc.shape(1) == Hkv && kc.shape(3) == D,
          "the caches do not agree with x or with each other");
    const int offset = offsets[c], length = lengths[c];
    check(length > 0 && length <= L && (C > 1 || length == L), "a row's length must be in 1 .. L");
    check(offset >= 0 && int64_t(offset) + length <= kc.shape(2), "needs room for the new positions in the cache");
  }
  check(norm_in.shape() == mx::Shape{hidden} && norm_post.shape() == mx::Shape{hidden}, "a norm's weight must be (hidden,)");
  check(n_heads > 0 && Hkv > 0 && n_heads % Hkv == 0, "the heads and caches do not agree");
  check(D > 0 && D % kHeadDimStep == 0 && D <= kMaxHeadDim, "takes head sizes that are multiples of 16 up to 512");
  check(rope_dims > 0 && rope_dims % 2 == 0 && rope_dims <= D, "rope dims must be even, positive and at most D");
  check(hidden % group_size == 0, "hidden must be a multiple of the group size");
  const int I = gate_up[0].shape(0);
  check_matrix(&qkv[0], n_heads * D, hidden, group_size, bits);
  check_matrix(&qkv[3], Hkv * D, hidden, group_size, bits);
  check_matrix(&qkv[6], Hkv * D, hidden, group_size, bits);
  check(qkv[1].dtype() == qkv[4].dtype() && qkv[1].dtype() == qkv[7].dtype(), "q, k and v must share the scales' type");
  check_matrix(&o[0], hidden, n_heads * D, group_size, bits);
  check_matrix(&gate_up[0], I, hidden, group_size, bits);
  check_matrix(&gate_up[3], I, hidden, group_size, bits);
  check(gate_up[1].dtype() == gate_up[4].dtype(), "gate and up must share the scales' type");
  check_matrix(&down[0], hidden, I, group_size, bits);
  for (size_t i = 0; i < qkv_bias.size(); ++i) {
    check(qkv_bias[i].shape() == mx::Shape{qkv[3 * i].shape(0)} && qkv_bias[i].dtype() == qkv[1].dtype(),
          "a bias must be (N,), of the scales' type");
  }
  check(packed.empty() || (packed.size() == 7 && bits == 4), "takes 7 packed matrices (4 bits) or none");
  if (!packed.empty()) {
    std::vector<mx::array> triples;
    for (const auto* group : {&qkv, &o, &gate_up, &down}) {
      triples.insert(triples.end(), group->begin(), group->end());
    }
    check_packed(packed, triples, group_size, bits);
  }
  std::vector<mx::array> inputs{x, row_contiguous(norm_in, stream), row_contiguous(norm_post, stream)};
  for (const auto* group : {&qkv, &o, &gate_up, &down}) {
    for (const auto& a : *group) {
      inputs.push_back(row_contiguous(a, stream));
    }
  }
  std::vector<mx::Shape> shapes{x.shape()};
  for (const auto* caches : {&k_caches, &v_caches}) {
    for (const auto& a : *caches) {
      inputs.push_back(a);
      shapes.push_back(a.shape());
    }
  }
  for (const auto& a : qkv_bias) {
    inputs.push_back(row_contiguous(a, stream));
  }
  for (const auto& a : packed) {
    inputs.push_back(row_contiguous(a, stream));
  }
  const DecoderLayer::Settings settings{
      eps_in, eps_post, group_size, bits, int(activation == "silu" ? GateAct::silu : GateAct::gelu_approx), n_heads,
      rope_dims, rope_traditional, rope_base, rope_scale, scale, !qkv_bias.empty(), !packed.empty(),
      offsets, lengths, causal, reuse};
  return mx::array::make_arrays(
      std::move(shapes),
      std::vector<mx::Dtype>(1 + 2 * C, mx::float32),
      std::make_shared<DecoderLayer>(stream, settings),
      std::move(inputs));
}

} // namespace specmlx
