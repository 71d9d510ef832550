// Argmax over a vocabulary row. MLX's CPU argmax is a scalar loop over the whole
// vocabulary: a greedy step paid it once, a greedy verify pass once per position, a greedy
// draft once per draft token. Here each vector lane keeps the first index of its own
// largest value; the lanes' winners then give the row's first largest.
#include "argmax.h"

#include <immintrin.h>

#include <stdexcept>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"
#include "strided.h"

namespace specmlx {
namespace {

// MLX's order: a NaN above every number, and among equals the earlier index. The best
// moves only to something above it, so a tie keeps the earlier index and the first NaN stays.
inline bool above(float x, float best) {
  return x > best || (x != x && best == best);
}

uint32_t argmax_scalar(const float* x, int from, int n, float best, uint32_t at) {
  for (int j = from; j < n; ++j) {
    if (above(x[j], best)) {
      best = x[j];
      at = uint32_t(j);
    }
  }
  return at;
}

// Lane winners to the row's: the largest value, at the smallest index among equals.
uint32_t pick(const float* best, const uint32_t* at, int lanes) {
  int w = 0;
  for (int l = 1; l < lanes; ++l) {
    const bool equal = best[l] == best[w] || (best[l] != best[l] && best[w] != best[w]);
    if (above(best[l], best[w]) || (equal && at[l] < at[w])) {
      w = l;
    }
  }
  return at[w];
}

SPECMLX_AVX512 uint32_t argmax_avx512(const float* x, int n) {
  const int full = n / 16 * 16;
  __m512 best = _mm512_set1_ps(x[0]);
  __m512i at = _mm512_setzero_si512();
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int j = 0; j < full; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
        (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
    best = _mm512_mask_mov_ps(best, larger, v);
    at = _mm512_mask_mov_epi32(at, larger, index);
    index = _mm512_add_epi32(index, step);
  }
  alignas(64) float b[16];
  alignas(64) uint32_t a[16];
  _mm512_store_ps(b, best);
  _mm512_store_si512(a, at);
  const uint32_t w = pick(b, a, 16);
  return argmax_scalar(x, full, n, x[w], w);
}

SPECMLX_AVX2 uint32_t argmax_avx2(const float* x, int n) {
  const int full = n / 8 * 8;
  __m256 best = _mm256_set1_ps(x[0]);
  __m256i at = _mm256_setzero_si256();
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  for (int j = 0; j < full; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 larger = _mm256_or_ps(
        _mm256_cmp_ps(v, best, _CMP_GT_OQ),
        _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(best, best, _CMP_ORD_Q)));
    best = _mm256_blendv_ps(best, v, larger);
    at = _mm256_blendv_epi8(at, index, _mm256_castps_si256(larger));
    index = _mm256_add_epi32(index, step);
  }
  alignas(32) float b[8];
  alignas(32) uint32_t a[8];
  _mm256_store_ps(b, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), at);
  const uint32_t w = pick(b, a, 8);
  return argmax_scalar(x, full, n, x[w], w);
}

uint32_t argmax_row(const float* x, int n) {
  switch (active_isa()) {
    case Isa::avx512:
      return argmax_avx512(x, n);
    case Isa::avx2:
      return argmax_avx2(x, n);
    case Isa::scalar:
      break;
  }
  return argmax_scalar(x, 1, n, x[0], 0);
}

} // namespace

void Argmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  const int ld = x.shape(-1), n = n_;
  uint32_t* dst = out.data<uint32_t>();
  const size_t rows = out.size();
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([x, dst, rows, ld, n] {
    thread_local std::vector<float> buf;
    const float* src = row_major(x, buf);  // logits are mostly a contiguous slice already
    for (size_t r = 0; r < rows; ++r) {
      dst[r] = argmax_row(src + r * ld, n);
    }
  });
}

void Argmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[specmlx] the native argmax has no GPU kernel");
}

mx::array argmax(const mx::array& x, int n, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] argmax runs on CPU streams only");
  }
  if (x.dtype() != mx::float32 || x.ndim() < 1 || n <= 0 || n > x.shape(-1)) {
    throw std::invalid_argument("[specmlx] argmax takes float32 rows (..., V) and 0 < n <= V");
  }
  auto shape = x.shape();
  shape.pop_back();
  return mx::array(shape, mx::uint32, std::make_shared<Argmax>(stream, n), {x});
}

} // namespace specmlx
