// Rotary position embedding. On the CPU mx.fast.rope runs as its decomposition, ~15 MLX ops
// a call (positions, frequencies, cos, sin, slices, products, concatenations), each
// dispatched on its own: 56 calls a step in a 28-layer model were ~840 of a decode step's
// ~2100 graph nodes. Here it is one op. Each row's angles depend on its position alone, so
// a row's result does not depend on the rows evaluated with it.
#include "rope.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"

namespace specmlx {

void rope_rows(const RopeJob& j) {
  const int half = j.dims / 2;
  // The frequencies as mx.fast.rope's fallback forms them: exp(-i * log(base) / half).
  std::vector<float> inv_freq(half), cos_t(size_t(j.T) * half), sin_t(size_t(j.T) * half);
  const float step = std::log(j.base) / float(half);
  for (int i = 0; i < half; ++i) {
    inv_freq[i] = std::exp(float(-i) * step);
  }
  for (int t = 0; t < j.T; ++t) {
    const float position = float(t + j.offset) * j.scale;
    for (int i = 0; i < half; ++i) {
      const float theta = position * inv_freq[i];
      cos_t[size_t(t) * half + i] = std::cos(theta);
      sin_t[size_t(t) * half + i] = std::sin(theta);
    }
  }
  for (int b = 0; b < j.B; ++b) {
    for (int h = 0; h < j.H; ++h) {
      for (int t = 0; t < j.T; ++t) {
        const float* x = j.x + b * j.stride_b + h * j.stride_h + t * j.stride_t;
        float* y = j.out + b * j.out_b + h * j.out_h + t * j.out_t;
        const float* c = cos_t.data() + size_t(t) * half;
        const float* s = sin_t.data() + size_t(t) * half;
        const int64_t sd = j.stride_d;
        if (j.traditional) {
          for (int i = 0; i < half; ++i) {
            const float x1 = x[2 * i * sd], x2 = x[(2 * i + 1) * sd];
            y[2 * i] = x1 * c[i] - x2 * s[i];
            y[2 * i + 1] = x1 * s[i] + x2 * c[i];
          }
        } else {
          for (int i = 0; i < half; ++i) {
            const float x1 = x[i * sd], x2 = x[(i + half) * sd];
            y[i] = x1 * c[i] - x2 * s[i];
            y[i + half] = x1 * s[i] + x2 * c[i];
          }
        }
        for (int d = j.dims; d < j.D; ++d) {
          y[d] = x[d * sd];
        }
      }
    }
  }
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& offset = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  const auto& x = inputs[0];
  const int T = x.shape(2), D = x.shape(3);
  RopeJob job{
      x.data<float>(),
      int64_t(x.strides(0)),
      int64_t(x.strides(1)),
      int64_t(x.strides(2)),
      int64_t(x.strides(3)),
      out.data<float>(),
      int64_t(x.shape(1)) * T * D,
      int64_t(T) * D,
      D,
      x.shape(0),
      x.shape(1),
      T,
      D,
      dims_,
      traditional_,
      base_,
      scale_,
      0};
  const int32_t* at = offset.data<int32_t>();
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(offset);
  encoder.set_output_array(out);
  encoder.dispatch([job, at]() mutable {
    job.offset = *at;  // read when the task runs: the offset may be computed in the graph
    rope_rows(job);
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[specmlx] the native RoPE has no GPU kernel");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
}

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] rope runs on CPU streams only");
  }
  if (x.dtype() != mx::float32 || x.ndim() != 4) {
    throw std::invalid_argument("[specmlx] rope takes a float32 (B, H, T, D) array");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(3)) {
    throw std::invalid_argument("[specmlx] rope dims must be even, positive and at most D");
  }
  if (offset.size() != 1 || offset.dtype() != mx::int32) {
    throw std::invalid_argument("[specmlx] rope takes one int32 offset");
  }
  // x goes in as it is (the kernel reads it through its strides: a transposed view of the
  // projections, mostly): an mx::contiguous node would copy it first.
  return mx::array(
      x.shape(), mx::float32, std::make_shared<Rope>(stream, dims, traditional, base, scale), {x, offset});
}

} // namespace specmlx
