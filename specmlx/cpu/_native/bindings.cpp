#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "argmax.h"
#include "attention.h"
#include "embedding.h"
#include "layer.h"
#include "mapped.h"
#include "mlx/version.h"
#include "amx.h"
#include "qmm.h"
#include "rms_norm.h"
#include "rope.h"
#include "softmax.h"

namespace nb = nanobind;
using namespace nb::literals;

#define SPECMLX_STR2(x) #x
#define SPECMLX_STR(x) SPECMLX_STR2(x)

NB_MODULE(_ext, m) {
  // mx.array's nanobind type lives in mlx.core (same NB_DOMAIN), so it must be loaded first.
  nb::module_::import_("mlx.core");
  m.doc() = "specmlx native INT4 CPU kernels (built against one exact mlx release)";
  m.attr("built_for_mlx") = SPECMLX_STR(MLX_VERSION_MAJOR) "." SPECMLX_STR(
      MLX_VERSION_MINOR) "." SPECMLX_STR(MLX_VERSION_PATCH);

  m.def(
      "quantized_matmul",
      [](const specmlx::mx::array& x,
         const specmlx::mx::array& w,
         const specmlx::mx::array& scales,
         const specmlx::mx::array& biases,
         int group_size,
         int bits,
         const std::optional<specmlx::mx::array>& bias,
         const std::optional<specmlx::mx::array>& packed) {
        return specmlx::quantized_matmul(x, w, scales, biases, group_size, bits, bias, packed);
      },
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a = 64,
      "bits"_a = 4,
      "bias"_a = nb::none(),
      "packed"_a = nb::none(),
      "x @ dequantize(w, scales, biases).T (+ bias, (N,) of the scales' type, on a float32 "
      "product) for 4/6/8-bit affine weights on the default CPU stream; packed: "
      "pack_quad(w, scales, biases), read in their place where the tiles take it.");
  m.def(
      "stacked_matmul",
      [](const specmlx::mx::array& x,
         const std::vector<specmlx::mx::array>& weights,
         const std::vector<specmlx::mx::array>& biases,
         int group_size,
         int bits,
         const std::vector<specmlx::mx::array>& packed) {
        return specmlx::stacked_matmul(x, weights, biases, group_size, bits, packed);
      },
      "x"_a,
      "weights"_a,
      "biases"_a,
      "group_size"_a = 64,
      "bits"_a = 4,
      "packed"_a = std::vector<specmlx::mx::array>{},
      "[x @ dequantize(w_i).T (+ bias_i) for each (w_i, scales_i, biases_i) of weights], one "
      "op on the default CPU stream: every matrix shares K and the scales' type; biases: one "
      "per matrix (a float32 product) or none.");
  m.def(
      "gated_matmul",
      [](const specmlx::mx::array& x,
         const specmlx::mx::array& w_gate,
         const specmlx::mx::array& scales_gate,
         const specmlx::mx::array& biases_gate,
         const specmlx::mx::array& w_up,
         const specmlx::mx::array& scales_up,
         const specmlx::mx::array& biases_up,
         int group_size,
         int bits,
         const std::string& activation,
         const std::vector<specmlx::mx::array>& packed) {
        return specmlx::gated_matmul(
            x, w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up, group_size, bits, activation, packed);
      },
      "x"_a,
      "w_gate"_a,
      "scales_gate"_a,
      "biases_gate"_a,
      "w_up"_a,
      "scales_up"_a,
      "biases_up"_a,
      "group_size"_a = 64,
      "bits"_a = 4,
      "activation"_a = "silu",
      "packed"_a = std::vector<specmlx::mx::array>{},
      "act(x @ dequantize(w_gate).T) * (x @ dequantize(w_up).T), act 'silu' or 'gelu_approx', "
      "x quantized once, on the default CPU stream.");
  m.def(
      "rope",
      [](const specmlx::mx::array& x, int dims, bool traditional, float base, float scale, const specmlx::mx::array& offset) {
        return specmlx::rope(x, dims, traditional, base, scale, offset);
      },
      "x"_a,
      "dims"_a,
      "traditional"_a,
      "base"_a,
      "scale"_a,
      "offset"_a,
      "mx.fast.rope's rotation of a float32 (B, H, T, D) array by positions offset + t (one "
      "int32 offset), on the default CPU stream.");
  m.def(
      "rms_norm",
      [](const specmlx::mx::array& x, const specmlx::mx::array& weight, float eps) {
        return specmlx::rms_norm(x, weight, eps);
      },
      "x"_a,
      "weight"_a,
      "eps"_a,
      "weight * x * rsqrt(mean(x^2) + eps) over the last axis of float32 rows, on the "
      "default CPU stream.");
  m.def(
      "argmax",
      [](const specmlx::mx::array& x, int n) { return specmlx::argmax(x, n); },
      "x"_a,
      "n"_a,
      "uint32 index of each float32 row's largest of its first n entries (the first of "
      "equals), as mx.argmax gives it, on the default CPU stream.");
  m.def(
      "softmax",
      [](const specmlx::mx::array& x) { return specmlx::softmax(x); },
      "x"_a,
      "Softmax over the last axis of a float32 array, on the default CPU stream.");
  m.def(
      "scaled_dot_product_attention",
      [](const specmlx::mx::array& q,
         const specmlx::mx::array& k,
         const specmlx::mx::array& v,
         float scale,
         bool causal,
         const std::optional<specmlx::mx::array>& sinks,
         int window,
         int64_t key_start,
         int rotation,
         const std::optional<specmlx::mx::array>& mask) {
        return specmlx::scaled_dot_product_attention(
            q, k, v, scale, causal, sinks, window, key_start, rotation, mask);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "scale"_a,
      "causal"_a = false,
      "sinks"_a = nb::none(),
      "window"_a = 0,
      "key_start"_a = 0,
      "rotation"_a = 0,
      "mask"_a = nb::none(),
      "softmax(q @ k.T * scale (+ causal mask)) @ v for float32 (B, H, L, D), GQA, on the "
      "default CPU stream; each query row's bits independent of the rows beside it. Key slot "
      "j holds position key_start + (j - rotation) mod Lk, the queries the newest ones; "
      "window > 0 limits a causal row to the last `window` positions; sinks (Hq,) join "
      "the softmax's denominator; mask (Lq, Lk) bool leaves out key slot j of row i where "
      "it is false.");
  m.def(
      "decoder_layer",
      [](const specmlx::mx::array& x,
         const specmlx::mx::array& norm_in,
         float eps_in,
         const std::vector<specmlx::mx::array>& qkv,
         const std::vector<specmlx::mx::array>& qkv_bias,
         const std::vector<specmlx::mx::array>& o,
         const specmlx::mx::array& norm_post,
         float eps_post,
         const std::vector<specmlx::mx::array>& gate_up,
         const std::vector<specmlx::mx::array>& down,
         const specmlx::mx::array& k_cache,
         const specmlx::mx::array& v_cache,
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
         const std::vector<specmlx::mx::array>& packed) {
        auto outs = specmlx::decoder_layer(
            x, norm_in, eps_in, qkv, qkv_bias, o, norm_post, eps_post, gate_up, down, k_cache, v_cache, group_size,
            bits, activation, n_heads, offset, rope_dims, rope_traditional, rope_base, rope_scale, scale, causal,
            reuse, packed);
        return std::make_tuple(outs[0], outs[1], outs[2]);
      },
      "x"_a,
      "norm_in"_a,
      "eps_in"_a,
      "qkv"_a,
      "qkv_bias"_a,
      "o"_a,
      "norm_post"_a,
      "eps_post"_a,
      "gate_up"_a,
      "down"_a,
      "k_cache"_a,
      "v_cache"_a,
      "group_size"_a,
      "bits"_a,
      "activation"_a,
      "n_heads"_a,
      "offset"_a,
      "rope_dims"_a,
      "rope_traditional"_a,
      "rope_base"_a,
      "rope_scale"_a,
      "scale"_a,
      "causal"_a,
      "reuse"_a = false,
      "packed"_a = std::vector<specmlx::mx::array>{},
      "One pre-norm decoder layer's step on a plain KV cache (x + o(attention(rms_norm(x))), "
      "then h + down(act(gate(m)) * up(m)) with m = rms_norm(h)) as one op. Returns (out, "
      "k_cache, v_cache), each bit as the chain of the layer's native ops.");
  m.def(
      "decoder_layer_rows",
      [](const specmlx::mx::array& x,
         const specmlx::mx::array& norm_in,
         float eps_in,
         const std::vector<specmlx::mx::array>& qkv,
         const std::vector<specmlx::mx::array>& qkv_bias,
         const std::vector<specmlx::mx::array>& o,
         const specmlx::mx::array& norm_post,
         float eps_post,
         const std::vector<specmlx::mx::array>& gate_up,
         const std::vector<specmlx::mx::array>& down,
         const std::vector<specmlx::mx::array>& k_caches,
         const std::vector<specmlx::mx::array>& v_caches,
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
         const std::vector<specmlx::mx::array>& packed) {
        auto outs = specmlx::decoder_layer_rows(
            x, norm_in, eps_in, qkv, qkv_bias, o, norm_post, eps_post, gate_up, down, k_caches, v_caches, group_size,
            bits, activation, n_heads, offsets, lengths, rope_dims, rope_traditional, rope_base, rope_scale, scale,
            causal, reuse, packed);
        const size_t C = k_caches.size();
        std::vector<specmlx::mx::array> ks(outs.begin() + 1, outs.begin() + 1 + C), vs(outs.begin() + 1 + C, outs.end());
        return std::make_tuple(outs[0], ks, vs);
      },
      "x"_a,
      "norm_in"_a,
      "eps_in"_a,
      "qkv"_a,
      "qkv_bias"_a,
      "o"_a,
      "norm_post"_a,
      "eps_post"_a,
      "gate_up"_a,
      "down"_a,
      "k_caches"_a,
      "v_caches"_a,
      "group_size"_a,
      "bits"_a,
      "activation"_a,
      "n_heads"_a,
      "offsets"_a,
      "lengths"_a,
      "rope_dims"_a,
      "rope_traditional"_a,
      "rope_base"_a,
      "rope_scale"_a,
      "scale"_a,
      "causal"_a,
      "reuse"_a,
      "packed"_a = std::vector<specmlx::mx::array>{},
      "decoder_layer's step for R sequences at once, each on its own (1, Hkv, S, D) cache: x "
      "(R, W, hidden) holds row r's lengths[r] new tokens first (the rest is padding, whose "
      "output rows are zeros); each row's bits are those of decoder_layer over that row alone. "
      "Returns (out, [k_cache per row], [v_cache per row]).");
  m.def(
      "cached_attention",
      [](const specmlx::mx::array& q,
         const specmlx::mx::array& k,
         const specmlx::mx::array& v,
         const specmlx::mx::array& k_cache,
         const specmlx::mx::array& v_cache,
         int n_heads,
         int offset,
         int rope_dims,
         bool rope_traditional,
         float rope_base,
         float rope_scale,
         float scale,
         bool causal,
         bool reuse) {
        auto outs = specmlx::cached_attention(
            q, k, v, k_cache, v_cache, n_heads, offset, rope_dims, rope_traditional, rope_base, rope_scale, scale,
            causal, reuse);
        return std::make_tuple(outs[0], outs[1], outs[2]);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "k_cache"_a,
      "v_cache"_a,
      "n_heads"_a,
      "offset"_a,
      "rope_dims"_a,
      "rope_traditional"_a,
      "rope_base"_a,
      "rope_scale"_a,
      "scale"_a,
      "causal"_a,
      "reuse"_a = false,
      "One attention layer's step on a plain KV cache: RoPE of q and k, k and v written at "
      "positions offset .. offset + L - 1 of the caches (B, Hkv, S, D), attention over "
      "positions up to each row's; q (B, L, Hq*D), k, v (B, L, Hkv*D). Returns (out (B, L, "
      "Hq*D), k_cache, v_cache), each bit as the rope op, the caches' slice updates and the "
      "attention op give it. reuse: the caller rebinds its only references to the caches to "
      "the new ones, which may then be the old buffers written in place.");
  m.def(
      "quantized_rows",
      [](const specmlx::mx::array& ids,
         const specmlx::mx::array& w,
         const specmlx::mx::array& scales,
         const specmlx::mx::array& biases,
         int group_size,
         int bits) { return specmlx::quantized_rows(ids, w, scales, biases, group_size, bits); },
      "ids"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      "Rows `ids` of an MLX affine-quantized table (4 or 8 bits), dequantized to float32 as "
      "mx.dequantize does with the gathered scales and biases cast to float32.");
  m.def(
      "map_tensors",
      &specmlx::map_tensors,
      "path"_a,
      "tensors"_a,
      "Per (offset, shape, dtype): an array over a read-only mapping of path (no copy), or "
      "None where the offset is not 8-byte aligned.");
  m.def(
      "mapping_unsupported",
      &specmlx::mapping_unsupported,
      "Why arrays cannot be built over a mapping with this mlx ('' when they can).");
  m.def("threads", &specmlx::threads, "Size of the kernel's thread pool.");
  m.def("set_threads", &specmlx::set_threads, "n"_a, "Resize the kernel's thread pool.");
  m.def("isa", &specmlx::isa, "The instruction set the kernel runs with.");
  m.def("set_isa", &specmlx::set_isa, "name"_a, "Force 'avx512', 'avx2' or 'scalar' (tests).");
  m.def("activations", &specmlx::activations, "What the kernels multiply: 'int8' or 'float32' x.");
  m.def(
      "set_activations",
      &specmlx::set_activations,
      "name"_a,
      "'int8': quantize x per 32-block for integer dot products; 'float32': x as is.");
  m.def("q8_kernel", &specmlx::q8_kernel, "The int8-activation tiles the ISA runs.");
  m.def(
      "pack_quad",
      &specmlx::pack_quad_matrix,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a = 64,
      "A 4-bit matrix (N a multiple of 4) laid out for the four-row tiles: each tile's "
      "codes, scales and biases in one stream (uint8, computed now).");
  m.def(
      "pack_quads",
      &specmlx::pack_quad_matrices,
      "matrices"_a,
      "group_size"_a = 64,
      "pack_quad of each [w, scales, biases] (one group size), in one mapping asked for huge "
      "pages.");
  m.def("reads_packed", &specmlx::reads_packed, "Whether the int8 tiles the ISA runs now read pack_quad's layout.");
  m.def("amx_available", &specmlx::amx_available, "Whether this CPU and OS let the kernel use AMX.");
  m.def("set_amx", &specmlx::set_amx, "on"_a, "Let int8 passes over many rows use AMX (default), or not (tests).");
  m.def("vbmi_available", &specmlx::vbmi_available, "Whether the 6-bit tiles can widen codes with AVX-512 VBMI.");
  m.def("set_vbmi", &specmlx::set_vbmi, "on"_a, "Let the 6-bit tiles use VBMI where present (default), or not (tests).");
}
