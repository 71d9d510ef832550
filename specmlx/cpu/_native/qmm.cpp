#include "qmm.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/mman.h>

#include "amx.h"
#include "kernels.h"
#include "mapped.h"
#include "scratch.h"
#include "strided.h"
#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"

namespace specmlx {
namespace {

// A matmul is split across threads only when each thread gets at least this much work
// (weights touched x (rows of x + 2), roughly the instruction count of the inner loop).
// Within a pass the pool's workers are still spinning from the last op, so a split is
// cheap: a 1536 x 1536 layer at one row (a 1.5B's q and o) splits, a 256-row k or v does
// not. (Three times this, the bound while workers parked between ops, left those q and o
// layers on one thread, which cost a 1.5B step time for nothing.)
constexpr size_t kMinWorkPerThread = size_t(1) << 20;

std::atomic<Isa> g_isa{detect_isa()};
std::atomic<Activations> g_activations{Activations::float32};

// Whether a product of these bits runs on int8 x. 6-bit codes have tiles for int8 x only:
// their ops are refused when built under float32 x (check_call), and one switched to float32
// after it was built still runs on int8 x rather than on tiles that do not read 6 bits.
bool uses_int8(int bits) {
  return bits == 6 || g_activations.load(std::memory_order_relaxed) == Activations::int8;
}

bool is_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::bfloat16 || t == mx::float16;
}

// Where x[k] (k within a group) lands in the packed, lane-ordered copy of x; the inverse of
// the code order the vector kernels produce (see Layout in kernels.cpp).
inline int pack_index(int k, int group_words, int lanes) {
  const int B = std::min(group_words, lanes), C = lanes / B, NV = 8 / C;
  const int word = k / 8, nibble = k % 8;
  const int block = word / B, w = word % B, v = nibble / C, c = nibble % C;
  return (block * NV + v) * lanes + c * B + w;
}

// Row stride of packed x. The kernels read up to 8 rows of x at the same offset; with the
// row sizes of real models (multiples of 1 KiB) those rows share a few L1 sets and evict
// each other. One cache line of padding staggers them across sets.
int row_stride(int K) {
  return K + 16;
}

template <typename T>
void pack_x(const T* src, float* dst, int M, int K, int ldx, int group_size, int lanes) {
  const int gw = group_size / 8;
  int perm[128];
  for (int k = 0; k < group_size; ++k) {
    perm[k] = lanes == 1 ? k : pack_index(k, gw, lanes);
  }
  for (int m = 0; m < M; ++m) {
    const T* s = src + size_t(m) * K;
    float* d = dst + size_t(m) * ldx;
    for (int base = 0; base < K; base += group_size) {
      for (int k = 0; k < group_size; ++k) {
        d[base + perm[k]] = static_cast<float>(s[base + k]);
      }
    }
  }
}

void pack_any(const void* src, mx::Dtype t, float* dst, int M, int K, int ldx, int gs, int lanes) {
  if (t == mx::float32) {
    pack_x(static_cast<const float*>(src), dst, M, K, ldx, gs, lanes);
  } else if (t == mx::bfloat16) {
    pack_x(static_cast<const mx::bfloat16_t*>(src), dst, M, K, ldx, gs, lanes);
  } else {
    pack_x(static_cast<const mx::float16_t*>(src), dst, M, K, ldx, gs, lanes);
  }
}

template <typename T>
void store_as(const float* y, void* out, size_t n) {
  std::transform(y, y + n, static_cast<T*>(out), [](float v) { return static_cast<T>(v); });
}

// The rows of x as float32, one at a time, into the int8 layout of kernels_q8.cpp.
template <typename T>
void quantize_x(const T* src, int M, int K, int gs, int bits, Isa isa, int8_t* q, float* d, float* s) {
  thread_local std::unique_ptr<float[]> row_buf;
  thread_local size_t row_cap = 0;
  float* row = std::is_same_v<T, float> ? nullptr : scratch(row_buf, row_cap, size_t(K));
  const size_t ldq = q8_row_bytes(K, isa), ldd = q8_row_scales(K, isa), ldg = q8_row_groups(K, gs);
  for (int m = 0; m < M; ++m) {
    const T* x = src + size_t(m) * K;
    const float* xf;
    if constexpr (std::is_same_v<T, float>) {
      xf = x;
    } else {
      std::transform(x, x + K, row, [](T v) { return static_cast<float>(v); });
      xf = row;
    }
    quantize_row_q8(xf, K, gs, bits, isa, q + m * ldq, d + m * ldd, s + m * ldg);
  }
}

void quantize_any(
    const void* src, mx::Dtype t, int M, int K, int gs, int bits, Isa isa, int8_t* q, float* d, float* s) {
  if (t == mx::float32) {
    quantize_x(static_cast<const float*>(src), M, K, gs, bits, isa, q, d, s);
  } else if (t == mx::bfloat16) {
    quantize_x(static_cast<const mx::bfloat16_t*>(src), M, K, gs, bits, isa, q, d, s);
  } else {
    quantize_x(static_cast<const mx::float16_t*>(src), M, K, gs, bits, isa, q, d, s);
  }
}

// x in the layout the kernels read (quantized to int8, or packed float32) into this
// thread's scratch; the job's x fields point at it.
void prepare_x(const MatmulCall& c, Isa isa, bool q8, QmmJob& job) {
  thread_local std::unique_ptr<float[]> x_buf;
  thread_local size_t x_cap = 0;
  if (q8) {
    thread_local std::unique_ptr<int8_t[]> q_buf;
    thread_local size_t q_cap = 0;
    job.ldq = q8_row_bytes(c.K, isa);
    job.ldd = q8_row_scales(c.K, isa);
    job.ldg = q8_row_groups(c.K, c.group_size);
    int8_t* q = scratch(q_buf, q_cap, size_t(c.M) * job.ldq);
    // d and the group sums share x's float scratch: together they are smaller than x.
    float* d = scratch(x_buf, x_cap, size_t(c.M) * (job.ldd + job.ldg));
    float* s = d + size_t(c.M) * job.ldd;
    quantize_any(c.x, c.x_type, c.M, c.K, c.group_size, c.bits, isa, q, d, s);
    job.xq = q;
    job.xd = d;
    job.xs = s;
    if (amx_rows(job, isa)) {
      prepare_x_amx(job);
    }
  } else {
    float* xp = scratch(x_buf, x_cap, size_t(c.M) * job.ldx);
    // 8-bit codes come out of memory in k order, so their x stays in k order too.
    const int lanes = c.bits == 4 ? isa_lanes(isa) : 1;
    pack_any(c.x, c.x_type, xp, c.M, c.K, job.ldx, c.group_size, lanes);
    job.x = xp;
  }
}

// How many threads a product of this much work (weights touched x (rows of x + 2)) over
// this many row pairs takes: see kMinWorkPerThread.
int threads_for(size_t work, int pairs) {
  const auto& pool = ThreadPool::instance();
  return int(std::clamp<size_t>(work / kMinWorkPerThread, 1, std::min(pool.size(), pairs)));
}

// Output rows [n0, n1) of product `product`.
struct RowRange {
  int product, n0, n1;
};

// The products' rows cut into ranges that the threads take as they come free (an atomic
// counter), not into one fixed share a thread. On a shared machine a thread can lose its
// core for a while (to another process, or to the Python thread building the next step's
// graph); with fixed shares the whole op waited for it, here the other thread takes over
// its ranges. About kRangesPerThread a thread, of at least kMinRangeRows rows: each range
// starts its streams (and their prefetch) afresh, and since the four-row tile reads one
// packed stream, 4 ranges a thread decode faster than 16 (bench/results/ARCHIVE.md, "packed
// weights"). Ranges are whole AMX tiles (16 rows; the vector tiles take 2 or 4); a row's
// result does not depend on its range (nor on its partners), so the results are those of
// any other cut.
constexpr int kRangesPerThread = 4, kMinRangeRows = 64;

std::vector<RowRange> row_ranges(const std::vector<int>& rows, int n_threads) {
  int total = 0;
  for (int n : rows) {
    total += n;
  }
  const int size = n_threads == 1 ? total : std::max(kMinRangeRows, (total / (kRangesPerThread * n_threads) + 15) / 16 * 16);
  std::vector<RowRange> ranges;
  for (int i = 0; i < int(rows.size()); ++i) {
    for (int n0 = 0; n0 < rows[i]; n0 += size) {
      ranges.push_back({i, n0, std::min(rows[i], n0 + size)});
    }
  }
  return ranges;
}

// Runs range(r) for every range on n_threads threads, each taking the next one left.
template <typename Fn>
void run_ranges(const std::vector<RowRange>& ranges, int n_threads, Fn&& range) {
  std::atomic<int> next{0};
  ThreadPool::instance().run(n_threads, [&](int) {
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < int(ranges.size());) {
      range(ranges[i]);
    }
  });
}

// Columns [n0, n1) of y (M rows of N) plus bias: the one rounding of MLX's y + bias.
void add_bias(float* y, const void* bias, ScaleType t, int M, int N, int n0, int n1) {
  for (int m = 0; m < M; ++m) {
    float* row = y + size_t(m) * N;
    for (int n = n0; n < n1; ++n) {
      row[n] += scale_at(bias, n, t);
    }
  }
}

// y (float32 scratch) into a half output; a float32 output was written in place.
void store_output(const float* y, void* out, mx::Dtype out_type, size_t n) {
  if (out_type == mx::bfloat16) {
    store_as<mx::bfloat16_t>(y, out, n);
  } else if (out_type == mx::float16) {
    store_as<mx::float16_t>(y, out, n);
  }
}

} // namespace

// x @ a^T, or with b: act(x @ a^T) * (x @ b^T). Threads take ranges of output
// columns (of both products) as they come free, and apply the activation to each range.
void run_matmul(const MatmulCall& c) {
  thread_local std::unique_ptr<float[]> y_buf, u_buf;
  thread_local size_t y_cap = 0, u_cap = 0;
  const Isa isa = g_isa.load(std::memory_order_relaxed);
  const size_t y_elems = size_t(c.M) * c.N;
  const bool gated = c.b.w != nullptr;

  float* y = c.out_type == mx::float32 ? static_cast<float*>(c.out) : scratch(y_buf, y_cap, y_elems);
  QmmJob job{
      nullptr, c.a.w, c.a.scales, c.a.biases, c.stype, y, c.M, c.N, c.K, c.group_size, c.bits, row_stride(c.K)};
  const bool q8 = uses_int8(c.bits);
  prepare_x(c, isa, q8, job);
  job.packed = c.a.packed;
  QmmJob up = job;
  if (gated) {
    up.w = c.b.w;
    up.scales = c.b.scales;
    up.biases = c.b.biases;
    up.packed = c.b.packed;
    up.y = scratch(u_buf, u_cap, y_elems);
  }
  const int n_threads = threads_for(size_t(c.N) * c.K * size_t(c.M + 2) * (gated ? 2 : 1), (c.N + 1) / 2);
  const auto rows = q8 ? qmm_rows_q8 : qmm_rows;
  run_ranges(row_ranges({c.N}, n_threads), n_threads, [&](const RowRange& r) {
    const int n0 = r.n0, n1 = r.n1;
    rows(isa, job, n0, n1);
    if (c.bias != nullptr) {
      add_bias(y, c.bias, c.stype, c.M, c.N, n0, n1);
    }
    if (gated) {
      rows(isa, up, n0, n1);
      for (int m = 0; m < c.M; ++m) {
        const size_t at = size_t(m) * c.N + n0;
        gate(isa, c.act, y + at, up.y + at, y + at, n1 - n0);
      }
    }
  });
  store_output(y, c.out, c.out_type, y_elems);
}

// x @ w_i^T (+ bias_i) for several matrices of one K: x prepared once, and the row pairs
// of all of them shared out among the threads in one run, so a small matrix (a k or v
// projection, 256 rows) costs neither a dispatch nor a thread of its own. Each row is
// computed as the plain product computes it (a pair never straddles two matrices).
void run_stacked(const MatmulCall& c, std::vector<MatmulProduct>& products) {
  thread_local std::vector<std::unique_ptr<float[]>> y_bufs;
  thread_local std::vector<size_t> y_caps;
  const Isa isa = g_isa.load(std::memory_order_relaxed);
  const bool q8 = uses_int8(c.bits);
  const size_t P = products.size();
  y_bufs.resize(std::max(y_bufs.size(), P));
  y_caps.resize(std::max(y_caps.size(), P), 0);
  QmmJob job{nullptr, nullptr, nullptr, nullptr, c.stype, nullptr, c.M, 0, c.K, c.group_size, c.bits, row_stride(c.K)};
  prepare_x(c, isa, q8, job);
  std::vector<QmmJob> jobs(P, job);
  std::vector<int> rows_of(P);
  size_t work = 0;
  int pairs = 0;
  for (size_t i = 0; i < P; ++i) {
    const MatmulProduct& p = products[i];
    QmmJob& j = jobs[i];
    j.w = p.w.w, j.scales = p.w.scales, j.biases = p.w.biases, j.packed = p.w.packed, j.N = p.N;
    j.y = c.out_type == mx::float32 ? static_cast<float*>(p.out)
                                     : scratch(y_bufs[i], y_caps[i], size_t(c.M) * p.N);
    rows_of[i] = p.N;
    pairs += (p.N + 1) / 2;
    work += size_t(p.N) * c.K * size_t(c.M + 2);
  }
  const int n_threads = threads_for(work, pairs);
  const auto rows = q8 ? qmm_rows_q8 : qmm_rows;
  run_ranges(row_ranges(rows_of, n_threads), n_threads, [&](const RowRange& r) {
    const QmmJob& j = jobs[r.product];
    rows(isa, j, r.n0, r.n1);
    if (products[r.product].bias != nullptr) {
      add_bias(j.y, products[r.product].bias, c.stype, c.M, j.N, r.n0, r.n1);
    }
  });
  for (size_t i = 0; i < P; ++i) {
    store_output(jobs[i].y, products[i].out, c.out_type, size_t(c.M) * products[i].N);
  }
}

namespace {

// x's buffer in row-major order, for a task: its own, or a gather of a view into this
// thread's scratch (float32, or the 16-bit halves as they are).
const void* row_major_x(const mx::array& x) {
  thread_local std::vector<float> x32;
  thread_local std::vector<uint16_t> x16;
  return x.dtype() == mx::float32 ? static_cast<const void*>(row_major(x, x32))
                                  : static_cast<const void*>(row_major(x, x16));
}

} // namespace

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  const int K = x.shape(-1);
  const int matrices = gated_ ? 2 : 1, first_packed = int(inputs.size()) - matrices;
  const auto weights = [&](int i, int m) {
    const uint8_t* packed = packed_ ? inputs[first_packed + m].data<uint8_t>() : nullptr;
    return MatmulWeights{inputs[i].data<uint32_t>(), inputs[i + 1].data<void>(), inputs[i + 2].data<void>(), packed};
  };
  MatmulCall call{
      nullptr,  // x: set in the task, where its layout is known
      x.dtype(),
      weights(1, 0),
      gated_ ? weights(4, 1) : MatmulWeights{nullptr, nullptr, nullptr},
      biased_ ? inputs[1 + 3 * matrices].data<void>() : nullptr,
      act_,
      scale_type(inputs[2].dtype()),
      out.data<void>(),
      out.dtype(),
      int(x.size() / K),
      w.shape(0),
      K,
      group_size_,
      bits_};
  // The weights are row-contiguous (the op made them so) and x is gathered so in the task
  // if it is not; MLX keeps input and output buffers alive until the stream has run it.
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  encoder.dispatch([call, x]() mutable {
    call.x = row_major_x(x);
    run_matmul(call);
  });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[specmlx] the native INT4 matmul has no GPU kernel");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && gated_ == o.gated_ && biased_ == o.biased_ &&
      act_ == o.act_ && packed_ == o.packed_;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

void StackedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const int K = x.shape(-1), P = int(outputs.size());
  std::vector<MatmulProduct> products;
  for (int i = 0; i < P; ++i) {
    outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    const int at = 1 + 3 * i;
    const uint8_t* packed = packed_ ? inputs[1 + (biased_ ? 4 : 3) * P + i].data<uint8_t>() : nullptr;
    products.push_back(
        {MatmulWeights{inputs[at].data<uint32_t>(), inputs[at + 1].data<void>(), inputs[at + 2].data<void>(), packed},
         biased_ ? inputs[1 + 3 * P + i].data<void>() : nullptr,
         outputs[i].data<void>(),
         inputs[at].shape(0)});
  }
  if (x.size() == 0) {
    return;
  }
  MatmulCall call{
      nullptr,  // x: set in the task, as for QuantizedMatmul
      x.dtype(),
      MatmulWeights{nullptr, nullptr, nullptr},
      MatmulWeights{nullptr, nullptr, nullptr},
      nullptr,
      GateAct::silu,
      scale_type(inputs[2].dtype()),
      nullptr,
      outputs[0].dtype(),
      int(x.size() / K),
      0,
      K,
      group_size_,
      bits_};
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    encoder.set_output_array(out);
  }
  encoder.dispatch([call, x, products]() mutable {
    call.x = row_major_x(x);
    run_stacked(call, products);
  });
}

void StackedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[specmlx] the native INT4 matmul has no GPU kernel");
}

bool StackedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const StackedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && biased_ == o.biased_ && packed_ == o.packed_;
}

std::vector<mx::Shape> StackedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  const int P = (int(inputs.size()) - 1) / (3 + int(biased_) + int(packed_));
  std::vector<mx::Shape> shapes;
  for (int i = 0; i < P; ++i) {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1 + 3 * i].shape(0);
    shapes.push_back(shape);
  }
  return shapes;
}

namespace {

void check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    throw std::invalid_argument("[specmlx] w must be a 2-D uint32 array of packed codes");
  }
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  const mx::Shape sshape{N, K / group_size};
  if (scales.shape() != sshape || biases.shape() != sshape || !is_float(scales.dtype()) ||
      biases.dtype() != scales.dtype()) {
    throw std::invalid_argument(
        "[specmlx] scales and biases must both be (N, K/group_size) arrays of one float type");
  }
}

// The op behind quantized_matmul and gated_matmul: weights is (w, scales, biases) once, or
// twice for the gated product; bias (plain products only) is added to the output.
// The checks every product makes: the stream, group size and bits, each (w, scales, biases)
// triple, and x against the first matrix's K, which every matrix must share (and its
// scales' type). Returns the CPU stream.
mx::Stream check_call(const mx::array& x, const std::vector<mx::array>& weights, int group_size, int bits, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] quantized_matmul runs on CPU streams only");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("[specmlx] group_size must be 32, 64 or 128");
  }
  if (bits != 4 && bits != 6 && bits != 8) {
    throw std::invalid_argument("[specmlx] bits must be 4, 6 or 8");
  }
  if (bits == 6 && g_activations.load(std::memory_order_relaxed) != Activations::int8) {
    throw std::invalid_argument("[specmlx] 6-bit weights take int8 activations only (set_activations('int8'))");
  }
  for (size_t i = 0; i < weights.size(); i += 3) {
    check_weights(weights[i], weights[i + 1], weights[i + 2], group_size, bits);
    if (weights[i].shape(1) != weights[0].shape(1) || weights[i + 1].dtype() != weights[1].dtype()) {
      throw std::invalid_argument("[specmlx] the matrices of one call must share K and the scales' type");
    }
  }
  const int K = weights[0].shape(1) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != K || !is_float(x.dtype())) {
    throw std::invalid_argument(
        "[specmlx] x must be float32/bfloat16/float16 with last dimension " + std::to_string(K));
  }
  return stream;
}

} // namespace

void check_packed(const std::vector<mx::array>& packed, const std::vector<mx::array>& weights, int group_size, int bits) {
  if (packed.empty()) {
    return;
  }
  if (packed.size() * 3 != weights.size() || bits != 4) {
    throw std::invalid_argument("[specmlx] packed matrices: one per 4-bit matrix, or none");
  }
  for (size_t i = 0; i < packed.size(); ++i) {
    const mx::array& w = weights[3 * i];
    const int N = w.shape(0), K = w.shape(1) * 8;
    const size_t bytes = size_t(N / 4) * packed_tile_bytes(K, group_size, scale_type(weights[3 * i + 1].dtype()));
    if (packed[i].dtype() != mx::uint8 || packed[i].ndim() != 1 || N % 4 != 0 || size_t(packed[i].size()) != bytes) {
      throw std::invalid_argument("[specmlx] a packed matrix must be pack_quad's uint8 array for its matrix");
    }
  }
}

namespace {

void check_bias(const mx::array& bias, int N, mx::Dtype scales, mx::Dtype out_type) {
  if (out_type != mx::float32 || bias.shape() != mx::Shape{N} || bias.dtype() != scales) {
    throw std::invalid_argument(
        "[specmlx] a bias must be (N,), of the scales' type, on a float32 product");
  }
}

mx::array qmm_op(
    const mx::array& x,
    const std::vector<mx::array>& weights,
    const std::optional<mx::array>& bias,
    GateAct act,
    int group_size,
    int bits,
    const std::vector<mx::array>& packed,
    mx::StreamOrDevice s) {
  const auto stream = check_call(x, weights, group_size, bits, s);
  check_packed(packed, weights, group_size, bits);
  const mx::array& w = weights[0];
  const int N = w.shape(0);
  if (weights.size() == 6 && weights[3].shape() != w.shape()) {
    throw std::invalid_argument("[specmlx] the gated matmul's two matrices must have one shape and scale type");
  }
  const auto out_type = mx::promote_types(x.dtype(), weights[1].dtype());
  if (bias) {
    check_bias(*bias, N, weights[1].dtype(), out_type);
  }
  auto out_shape = x.shape();
  out_shape.back() = N;
  std::vector<mx::array> inputs{x};  // as it is: the task gathers a view (see eval_cpu)
  for (const auto& a : weights) {
    inputs.push_back(row_contiguous(a, stream));
  }
  if (bias) {
    inputs.push_back(row_contiguous(*bias, stream));
  }
  for (const auto& a : packed) {
    inputs.push_back(row_contiguous(a, stream));
  }
  return mx::array(
      std::move(out_shape),
      out_type,
      std::make_shared<QuantizedMatmul>(
          stream, group_size, bits, weights.size() == 6, bias.has_value(), act, !packed.empty()),
      std::move(inputs));
}

} // namespace

mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    const std::optional<mx::array>& bias,
    const std::optional<mx::array>& packed,
    mx::StreamOrDevice s) {
  std::vector<mx::array> packs;
  if (packed) {
    packs.push_back(*packed);
  }
  return qmm_op(x, {w, scales, biases}, bias, GateAct::silu, group_size, bits, packs, s);
}

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
    const std::string& activation,
    const std::vector<mx::array>& packed,
    mx::StreamOrDevice s) {
  if (activation != "silu" && activation != "gelu_approx") {
    throw std::invalid_argument("[specmlx] the gated matmul's activation is silu or gelu_approx");
  }
  const GateAct act = activation == "silu" ? GateAct::silu : GateAct::gelu_approx;
  return qmm_op(
      x, {w_gate, scales_gate, biases_gate, w_up, scales_up, biases_up}, std::nullopt, act, group_size, bits, packed, s);
}

std::vector<mx::array> stacked_matmul(
    const mx::array& x,
    const std::vector<mx::array>& weights,
    const std::vector<mx::array>& biases,
    int group_size,
    int bits,
    const std::vector<mx::array>& packed,
    mx::StreamOrDevice s) {
  if (weights.empty() || weights.size() % 3 != 0) {
    throw std::invalid_argument("[specmlx] stacked_matmul takes (w, scales, biases) for each matrix");
  }
  const size_t P = weights.size() / 3;
  if (!biases.empty() && biases.size() != P) {
    throw std::invalid_argument("[specmlx] stacked_matmul takes a bias for every matrix or for none");
  }
  const auto stream = check_call(x, weights, group_size, bits, s);
  check_packed(packed, weights, group_size, bits);
  const auto out_type = mx::promote_types(x.dtype(), weights[1].dtype());
  std::vector<mx::array> inputs{x};  // as it is: the task gathers a view
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < P; ++i) {
    const int N = weights[3 * i].shape(0);
    if (!biases.empty()) {
      check_bias(biases[i], N, weights[1].dtype(), out_type);
    }
    for (size_t k = 3 * i; k < 3 * i + 3; ++k) {
      inputs.push_back(row_contiguous(weights[k], stream));
    }
    auto shape = x.shape();
    shape.back() = N;
    shapes.push_back(std::move(shape));
  }
  for (const auto& bias : biases) {
    inputs.push_back(row_contiguous(bias, stream));
  }
  for (const auto& a : packed) {
    inputs.push_back(row_contiguous(a, stream));
  }
  return mx::array::make_arrays(
      std::move(shapes),
      std::vector<mx::Dtype>(P, out_type),
      std::make_shared<StackedMatmul>(stream, group_size, bits, !biases.empty(), !packed.empty()),
      std::move(inputs));
}

namespace {

constexpr size_t kHugePage = size_t(2) << 20;

// The packed copies of a model's layers, in one anonymous mapping whose 2 MiB pages Linux
// is asked to back with huge pages (where THP is "madvise", the default on most
// distributions; a no-op where it is "never"). A decode step streams every packed weight
// once, and on 4 KiB pages that is a page walk every 4 KiB. A fresh mapping, not the
// allocator's memory: pages the allocator reuses were faulted in small already, and one
// mapping for all the layers leaves no small copy (q/k/v) and no edge of a copy off huge
// pages. The allocator's memory advised page by page got only part of the packed bytes
// huge; this mapping gets all of them, and decodes faster for it at the cost of a slower
// load, the huge pages' faults (bench/results/ARCHIVE.md, "huge pages"). Each copy is laid
// out as MLX's CPU buffers are, [size_t bytes][data] (see mapped.cpp), so that its array's
// buffer size is its own.
struct Arena {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Arena() {
    if (base != MAP_FAILED) {
      munmap(base, size);
    }
  }
};

size_t round_up_to(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

struct PackJob {
  std::vector<mx::array> parts;  // w, scales, biases, row-contiguous and evaluated
  int N, K;
  ScaleType t;
  size_t tile;
  size_t bytes() const {
    return size_t(N / 4) * tile;
  }
};

PackJob pack_job(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size) {
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("[specmlx] group_size must be 32, 64 or 128");
  }
  check_weights(w, scales, biases, group_size, 4);
  const int N = w.shape(0), K = w.shape(1) * 8;
  if (N % 4 != 0) {
    throw std::invalid_argument("[specmlx] pack_quad takes matrices of a multiple of 4 rows");
  }
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  const ScaleType t = scale_type(scales.dtype());
  return {{row_contiguous(w, cpu), row_contiguous(scales, cpu), row_contiguous(biases, cpu)}, N, K, t,
          packed_tile_bytes(K, group_size, t)};
}

void run_pack(const PackJob& job, int group_size, uint8_t* out) {
  const auto* wp = reinterpret_cast<const uint8_t*>(job.parts[0].data<uint32_t>());
  const auto* sp = static_cast<const uint8_t*>(job.parts[1].data<void>());
  const auto* bp = static_cast<const uint8_t*>(job.parts[2].data<void>());
  const size_t groups = size_t(job.K / group_size), elem = job.parts[1].itemsize(), tiles = size_t(job.N / 4);
  auto& pool = ThreadPool::instance();
  const int n = pool.size();
  pool.run(n, [&](int i) {  // each thread its share of the tiles
    const int t0 = int(tiles * i / n), t1 = int(tiles * (i + 1) / n);
    pack_quad(wp + size_t(4 * t0) * (job.K / 2), sp + size_t(4 * t0) * groups * elem,
              bp + size_t(4 * t0) * groups * elem, 4 * (t1 - t0), job.K, group_size, job.t,
              out + size_t(t0) * job.tile);
  });
}

} // namespace

std::vector<mx::array> pack_quad_matrices(const std::vector<std::vector<mx::array>>& matrices, int group_size) {
  std::vector<PackJob> jobs;
  for (const auto& m : matrices) {
    if (m.size() != 3) {
      throw std::invalid_argument("[specmlx] pack_quads takes (w, scales, biases) triples");
    }
    jobs.push_back(pack_job(m[0], m[1], m[2], group_size));
  }
  std::vector<mx::array> out;
  if (!mapping_unsupported().empty()) {  // not MLX's [size][data] buffers: the allocator's memory
    for (auto& job : jobs) {
      mx::eval(job.parts);
      out.emplace_back(mx::allocator::malloc(job.bytes()), mx::Shape{int(job.bytes())}, mx::uint8);
      run_pack(job, group_size, out.back().data<uint8_t>());
    }
    return out;
  }
  std::vector<size_t> at;  // each copy's data offset: 64-byte aligned, its size in front
  size_t end = 0;
  for (const auto& job : jobs) {
    at.push_back(round_up_to(end + sizeof(size_t), 64));
    end = at.back() + job.bytes();
  }
  auto arena = std::make_shared<Arena>();
  arena->size = round_up_to(end, kHugePage) + kHugePage;  // room to start on a huge page
  arena->base = mmap(nullptr, arena->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (arena->base == MAP_FAILED) {
    throw std::runtime_error("[specmlx] cannot map " + std::to_string(arena->size) + " bytes for packed weights");
  }
  auto* start = reinterpret_cast<uint8_t*>(round_up_to(reinterpret_cast<uintptr_t>(arena->base), kHugePage));
  madvise(start, round_up_to(end, kHugePage), MADV_HUGEPAGE);  // advice: failure is harmless
  for (size_t i = 0; i < jobs.size(); ++i) {
    mx::eval(jobs[i].parts);
    uint8_t* data = start + at[i];
    const size_t bytes = jobs[i].bytes();
    std::memcpy(data - sizeof(size_t), &bytes, sizeof(size_t));
    run_pack(jobs[i], group_size, data);
    jobs[i].parts.clear();
    mx::allocator::Data held(mx::allocator::Buffer(data - sizeof(size_t)), [arena](mx::allocator::Buffer) {});
    out.emplace_back(std::move(held), mx::Shape{int(bytes)}, mx::uint8);
  }
  return out;
}

mx::array pack_quad_matrix(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size) {
  return pack_quad_matrices({{w, scales, biases}}, group_size)[0];
}

bool reads_packed() {
  return quad_tiles(g_isa.load());
}

int threads() {
  return ThreadPool::instance().size();
}

void set_threads(int n) {
  ThreadPool::instance().resize(n);
}

Isa active_isa() {
  return g_isa.load(std::memory_order_relaxed);
}

const char* isa() {
  return isa_name(g_isa.load());
}

void set_isa(const std::string& name) {
  const Isa best = detect_isa();
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (name == isa_name(i)) {
      if (i > best) {
        throw std::invalid_argument(
            "[specmlx] this CPU does not support " + name + " (best: " + isa_name(best) + ")");
      }
      g_isa.store(i);
      return;
    }
  }
  throw std::invalid_argument("[specmlx] unknown ISA " + name + "; use avx512, avx2 or scalar");
}

const char* activations() {
  return g_activations.load() == Activations::int8 ? "int8" : "float32";
}

void set_activations(const std::string& name) {
  if (name != "int8" && name != "float32") {
    throw std::invalid_argument("[specmlx] unknown activations " + name + "; use int8 or float32");
  }
  g_activations.store(name == "int8" ? Activations::int8 : Activations::float32);
}

std::string q8_kernel() {
  const Isa isa = g_isa.load();
  // amx_rows' condition; AMX CPUs all have VNNI, so their avx512 tiles are vnni512
  const std::string tiles = q8_kernel_name(isa);
  return isa == Isa::avx512 && amx_enabled() ? tiles + ", amx from 16 rows" : tiles;
}

} // namespace specmlx
