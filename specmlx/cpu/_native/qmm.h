// The MLX op and primitive: y = x @ dequantize(w, scales, biases)^T for 4- and 8-bit
// affine weights.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "kernels.h"

namespace specmlx {

namespace mx = mlx::core;

// x: (..., K) float32/bfloat16/float16; w: (N, K*bits/32) uint32; scales, biases:
// (N, K/group_size) float32/bfloat16/float16. Returns (..., N) in promote_types(x, scales),
// like mx.quantized_matmul(..., transpose=True, bits=bits), plus `bias` ((N,), of the
// scales' type; a float32 product only) if given. CPU streams only. `packed`: the matrix as
// pack_quad lays it out, read in its place by the tiles that take it (every op below takes
// one per matrix, or none).
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    const std::optional<mx::array>& bias = std::nullopt,
    const std::optional<mx::array>& packed = std::nullopt,
    mx::StreamOrDevice s = {});

// act(x @ dequantize(w_gate)^T) * (x @ dequantize(w_up)^T), act "silu" or "gelu_approx": a
// gated MLP's first half in one op, x quantized once, both matrices of one shape and scale
// type.
mx::array gated_matmul(
    const mx::array& x,
    const mx::array& w_gate,
    const mx::array& scales_gate,
    const mx::array& biases_gate,
    const mx::array& w_up,
    const mx::array& scales_up,
    const mx::array& biases_up,
    int group_size,
    int bits,
    const std::string& activation = "silu",
    const std::vector<mx::array>& packed = {},
    mx::StreamOrDevice s = {});

// x @ dequantize(w_i)^T (+ bias_i) for several matrices of one K and scale type (a layer's
// q, k and v projections): `weights` holds (w, scales, biases) per matrix, `biases` one
// bias per matrix or none. One output per matrix, each bitwise the plain product's, from
// one op: x quantized once and every matrix's rows shared out among the threads together.
std::vector<mx::array> stacked_matmul(
    const mx::array& x,
    const std::vector<mx::array>& weights,
    const std::vector<mx::array>& biases,
    int group_size,
    int bits,
    const std::vector<mx::array>& packed = {},
    mx::StreamOrDevice s = {});

// A 4-bit matrix's (w, scales, biases), N a multiple of 4, laid out for the four-row
// tiles (pack_quad in kernels.h: each tile's codes, scales and biases one stream),
// as a 1-D uint8 array, computed now.
mx::array pack_quad_matrix(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size);
// The same for several matrices (w, scales, biases) of one group size, in one mapping
// asked for huge pages (what native.pack_layers takes a model's layers through).
std::vector<mx::array> pack_quad_matrices(const std::vector<std::vector<mx::array>>& matrices, int group_size);

// Whether the int8 tiles the ISA runs now read pack_quad's layout (four-row AVX-512 VNNI or AVX2).
bool reads_packed();

// Throws unless packed is empty or holds pack_quad's array for each (w, scales, biases)
// triple of weights.
void check_packed(const std::vector<mx::array>& packed, const std::vector<mx::array>& weights, int group_size, int bits);

// Both ops' primitive: inputs x, w, scales, biases; then the up matrix's three for the
// gated product; then the bias, if any; then the packed matrices, if any.
class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool gated, bool biased, GateAct act, bool packed)
      : mx::UnaryPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        gated_(gated),
        biased_(biased),
        act_(act),
        packed_(packed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "SpecmlxQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  bool gated_;
  bool biased_;
  GateAct act_;
  bool packed_;
};

// stacked_matmul's primitive: inputs x, then (w, scales, biases) per matrix, then the
// biases, if any, then the packed matrices, if any; one output per matrix.
class StackedMatmul : public mx::Primitive {
 public:
  StackedMatmul(mx::Stream stream, int group_size, int bits, bool biased, bool packed)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), biased_(biased), packed_(packed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "SpecmlxStackedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  bool biased_;
  bool packed_;
};

// The tasks behind the ops, for an op that runs them as steps of its own (layer.cpp): x
// row-major, every pointer to a buffer the task may use.
struct MatmulWeights {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  const uint8_t* packed = nullptr;  // pack_quad's layout of the same matrix, or null
};

struct MatmulCall {
  const void* x;
  mx::Dtype x_type;
  MatmulWeights a;
  MatmulWeights b;  // the gated matmul's second matrix (up); w null for a plain matmul
  const void* bias;  // (N,) added to a plain matmul's float32 output; null for none
  GateAct act;  // the gated product's activation
  ScaleType stype;  // of the scales, biases and bias
  void* out;
  mx::Dtype out_type;
  int M, N, K, group_size, bits;
};

// One product of a stacked call: its matrix, optional bias, and output.
struct MatmulProduct {
  MatmulWeights w;
  const void* bias;
  void* out;
  int N;
};

void run_matmul(const MatmulCall& call);
void run_stacked(const MatmulCall& call, std::vector<MatmulProduct>& products);

// Settings visible from Python (for tests and benchmarks).
Isa active_isa();  // the kernels' ISA: the best detected, or the one set_isa forced
int threads();
void set_threads(int n);
const char* isa();
void set_isa(const std::string& name);  // "avx512" | "avx2" | "scalar"; must be supported

// What the kernels multiply: x as float32, or x quantized to int8 per 32-block
// (kernels_q8.cpp). Read when a matmul is evaluated, like the ISA.
enum class Activations { float32, int8 };
const char* activations();
void set_activations(const std::string& name);  // "int8" | "float32"
std::string q8_kernel();  // the int8 tiles the current ISA runs: vnni512(+vbmi), avx2 or scalar

} // namespace specmlx
