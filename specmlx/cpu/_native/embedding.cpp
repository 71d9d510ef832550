// A quantized embedding's lookup. On the CPU nn.QuantizedEmbedding's gathers, casts and
// mx.dequantize run as ~38 MLX ops a step (the shifts, masks, products and sums of the
// unpacking, each dispatched on its own); here it is one op. The values are computed as
// MLX's decomposition computes them, q * scale then + bias, each rounded to float32.
#include "embedding.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "strided.h"

namespace specmlx {
namespace {

struct RowsJob {
  const void* ids;
  bool ids_signed;
  size_t n_ids;
  const uint32_t* w;
  const void* scales;
  const void* biases;
  ScaleType stype;
  float* out;
  int64_t V;
  int K, group_size, bits;
};

// One row: plain scalar float code (the baseline ISA has no FMA to contract it into), so
// each value is round(round(q * s) + b) as MLX's separate multiply and add give it.
void dequantize_row(const RowsJob& j, int64_t row, float* y) {
  const int groups = j.K / j.group_size;
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(j.w) + row * (size_t(j.K) * j.bits / 8);
  for (int g = 0; g < groups; ++g) {
    const float s = scale_at(j.scales, size_t(row) * groups + g, j.stype);
    const float b = scale_at(j.biases, size_t(row) * groups + g, j.stype);
    for (int k = g * j.group_size; k < (g + 1) * j.group_size; ++k) {
      const float q = float(code_at(codes, k, j.bits));
      const float scaled = q * s;
      y[k] = scaled + b;
    }
  }
}

void run(const RowsJob& j) {
  for (size_t i = 0; i < j.n_ids; ++i) {
    int64_t row = j.ids_signed ? int64_t(static_cast<const int32_t*>(j.ids)[i])
                               : int64_t(static_cast<const uint32_t*>(j.ids)[i]);
    row += row < 0 ? j.V : 0;  // MLX's negative indices count from the end
    float* y = j.out + i * size_t(j.K);
    if (row < 0 || row >= j.V) {  // no row to read: NaN, never memory outside the table
      std::fill(y, y + j.K, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    dequantize_row(j, row, y);
  }
}

} // namespace

std::vector<mx::Shape> QuantizedRows::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.push_back(inputs[1].shape(1) * 32 / bits_);
  return {shape};
}

void QuantizedRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const auto &ids = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
  RowsJob job{
      nullptr,  // ids: set in the task, where their layout is known
      ids.dtype() == mx::int32,
      ids.size(),
      w.data<uint32_t>(),
      scales.data<void>(),
      biases.data<void>(),
      scale_type(scales.dtype()),
      out.data<float>(),
      w.shape(0),
      int(w.shape(1) * 32 / bits_),
      group_size_,
      bits_};
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  encoder.dispatch([job, ids]() mutable {
    thread_local std::vector<uint32_t> id_buf;  // int32 and uint32 ids alike: 4-byte copies
    job.ids = row_major(ids, id_buf);
    run(job);
  });
}

void QuantizedRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[specmlx] the native quantized rows have no GPU kernel");
}

mx::array quantized_rows(
    const mx::array& ids,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] quantized rows run on CPU streams only");
  }
  if (ids.dtype() != mx::int32 && ids.dtype() != mx::uint32) {
    throw std::invalid_argument("[specmlx] quantized rows take int32 or uint32 ids");
  }
  if (bits != 4 && bits != 6 && bits != 8) {
    throw std::invalid_argument("[specmlx] quantized rows take 4, 6 or 8 bits");
  }
  const bool floats = scales.dtype() == biases.dtype() &&
      (scales.dtype() == mx::float32 || scales.dtype() == mx::float16 || scales.dtype() == mx::bfloat16);
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || !floats || scales.ndim() != 2 || scales.shape() != biases.shape()) {
    throw std::invalid_argument("[specmlx] quantized rows take uint32 (V, K*bits/32) codes and float scales, biases");
  }
  const int K = w.shape(1) * 32 / bits;
  if (group_size <= 0 || K % group_size != 0 || scales.shape(0) != w.shape(0) || scales.shape(1) != K / group_size) {
    throw std::invalid_argument("[specmlx] quantized rows: the scales do not match the codes' groups");
  }
  // ids as they are (the task gathers a view: in a pipelined decode they are the last
  // step's lazy token), the table row-contiguous as the task reads it.
  std::vector<mx::array> inputs{ids};
  for (const auto* a : {&w, &scales, &biases}) {
    inputs.push_back(row_contiguous(*a, stream));
  }
  auto shape = ids.shape();
  shape.push_back(K);
  return mx::array(shape, mx::float32, std::make_shared<QuantizedRows>(stream, group_size, bits), std::move(inputs));
}

} // namespace specmlx
