// Calibration's loss head over a large vocabulary (`calibrate.head_nll`), the part after the bfloat16 product: per
// row of its logits, the largest `k` and the target's recomputed in float32, the row's max and the sum of
// exp(logit - max) over the other logits, in two passes over the bfloat16 row (the second reads it from the core's
// cache), then the target's NLL: no float32 copy of the logits, no gathered weight rows. Rows in parallel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "native_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using infinigen_native::exp_nonpositive;

constexpr int64_t kBlock = 512;  // logits converted to float32 at once (a stack buffer)
constexpr size_t kHeld = 1024;  // candidates for the largest held before they are cut back to k (or 2k)

struct Logit {
  float value;
  int64_t index;
};

// The ranking: the larger logit first; equal logits, the lower index first.
inline bool before(const Logit& a, const Logit& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// bfloat16 bits [n] to float32 (a bfloat16 is a float32's upper half).
inline void widen(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bits = static_cast<uint32_t>(src[j]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[j] = f;
  }
}

// `held` cut back to its k first in the ranking; returns the last one's value (what a later logit must exceed).
inline float cut(std::vector<Logit>& held, int64_t k) {
  std::nth_element(held.begin(), held.begin() + (k - 1), held.end(), before);
  held.resize(k);
  float least = held[0].value;
  for (const Logit& l : held) least = std::min(least, l.value);
  return least;
}

// One row: its k largest (ranked, into `top`), its max; whether every logit is finite. Pass 1 of `row_stats`.
bool largest(const uint16_t* row, int64_t vocab, int64_t k, int64_t* top, float& mx, std::vector<Logit>& held) {
  float x[kBlock];
  float threshold = -std::numeric_limits<float>::infinity();
  mx = -std::numeric_limits<float>::infinity();
  held.clear();
  const size_t most = std::max(kHeld, static_cast<size_t>(2 * k));
  for (int64_t b0 = 0; b0 < vocab; b0 += kBlock) {
    const int64_t len = std::min(kBlock, vocab - b0);
    widen(row + b0, x, len);
    float block_max = -std::numeric_limits<float>::infinity();
    float poison = 0.f;  // x - x: 0 for a finite logit, NaN for an infinite or NaN one
#pragma omp simd reduction(max : block_max) reduction(+ : poison)
    for (int64_t j = 0; j < len; ++j) {
      block_max = block_max > x[j] ? block_max : x[j];
      poison += x[j] - x[j];
    }
    if (poison != 0.f) return false;  // NaN: the caller takes torch's path for this row
    mx = std::max(mx, block_max);
    if (k == 0 || !(block_max > threshold)) continue;
    for (int64_t j = 0; j < len; ++j) {
      if (x[j] > threshold) {  // an equal later logit ranks after the k held: never among the largest
        held.push_back({x[j], b0 + j});
        if (held.size() >= most) threshold = cut(held, k);
      }
    }
  }
  if (k > 0) {
    if (static_cast<int64_t>(held.size()) > k) cut(held, k);
    std::sort(held.begin(), held.end(), before);
    for (int64_t i = 0; i < k; ++i) top[i] = held[i].index;
  }
  return true;
}

// One row's sum of exp(logit - mx) over every logit but those at `skip` (ascending). Pass 2 of `row_stats`.
double rest_sum(const uint16_t* row, int64_t vocab, float mx, const std::vector<int64_t>& skip) {
  float x[kBlock];
  double total = 0.0;
  size_t s = 0;
  for (int64_t b0 = 0; b0 < vocab; b0 += kBlock) {
    const int64_t len = std::min(kBlock, vocab - b0);
    widen(row + b0, x, len);
    for (; s < skip.size() && skip[s] < b0 + len; ++s) x[skip[s] - b0] = -std::numeric_limits<float>::infinity();
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) sum += exp_nonpositive(x[j] - mx);  // exp(-inf) is 0
    total += sum;
  }
  return total;
}

// The float32 logit h . w over d (the exact value `row_nll` takes for a recomputed logit).
inline float dot(const float* h, const float* w, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < d; ++j) sum += h[j] * w[j];
  return sum;
}

// logits [n, vocab] bfloat16 (= h @ weight.T as a bfloat16 product; rows contiguous), h [n, d] and weight [vocab, d]
// float32, targets [n] int64 ->
//   nll [n] float32: each row's -log softmax at its target, the logits of its k largest (in `logits`) and its
//   target's recomputed in float32 from h and weight, the rest as `logits` holds them;
//   top [n, k] int64: those k largest logits' indices, ranked (larger first; equal ones, the lower index first);
//   finite [n] bool: false where a logit of the row is infinite or NaN (that row's nll and top are not set).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> row_nll(const torch::Tensor& logits, const torch::Tensor& h,
                                                                const torch::Tensor& weight,
                                                                const torch::Tensor& targets, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kBFloat16 && logits.device().is_cpu(),
              "logits: [n, vocab] bfloat16 on the CPU");
  TORCH_CHECK(logits.stride(1) == 1, "logits: each row contiguous");
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(h.dim() == 2 && h.size(0) == n && h.scalar_type() == torch::kFloat, "h: [n, d] float32");
  const int64_t d = h.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == vocab && weight.size(1) == d &&
              weight.scalar_type() == torch::kFloat, "weight: [vocab, d] float32");
  TORCH_CHECK(k >= 0 && k <= vocab, "k must lie in [0, vocab]");
  auto hc = h.contiguous();
  auto wc = weight.contiguous();
  auto tg = targets.to(torch::kLong).contiguous();
  TORCH_CHECK(tg.dim() == 1 && tg.size(0) == n, "targets: [n]");
  const int64_t* tg_p = tg.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(tg_p[i] >= 0 && tg_p[i] < vocab, "a target outside the vocabulary");
  auto opts = torch::TensorOptions().device(torch::kCPU);
  auto nll = torch::zeros({n}, opts.dtype(torch::kFloat));
  auto top = torch::zeros({n, k}, opts.dtype(torch::kLong));
  auto finite = torch::zeros({n}, opts.dtype(torch::kBool));
  const auto* base = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>());
  const int64_t stride = logits.stride(0);
  const float* h_p = hc.data_ptr<float>();
  const float* w_p = wc.data_ptr<float>();
  float* nll_p = nll.data_ptr<float>();
  int64_t* top_p = top.data_ptr<int64_t>();
  bool* finite_p = finite.data_ptr<bool>();
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    std::vector<Logit> held;
    held.reserve(kHeld);
    std::vector<int64_t> skip;
    std::vector<double> values;
    for (int64_t i = lo; i < hi; ++i) {
      const uint16_t* row = base + i * stride;
      int64_t* row_top = top_p + i * k;
      float mx;
      if (!largest(row, vocab, k, row_top, mx, held)) continue;
      finite_p[i] = true;
      skip.assign(row_top, row_top + k);
      if (std::find(skip.begin(), skip.end(), tg_p[i]) == skip.end()) skip.push_back(tg_p[i]);
      std::sort(skip.begin(), skip.end());
      const double rest = rest_sum(row, vocab, mx, skip);  // relative to the bfloat16 max
      // the recomputed logits (the top k and the target, each once) in float32; the sum taken from their max
      const float* row_h = h_p + i * d;
      double top_exact = mx;
      double target_logit = 0.0;
      values.resize(skip.size());
      for (size_t s = 0; s < skip.size(); ++s) {
        values[s] = dot(row_h, w_p + skip[s] * d, d);
        top_exact = std::max(top_exact, values[s]);
        if (skip[s] == tg_p[i]) target_logit = values[s];
      }
      double sum = rest * std::exp(static_cast<double>(mx) - top_exact);
      for (double v : values) sum += std::exp(v - top_exact);
      nll_p[i] = static_cast<float>(std::log(sum) + top_exact - target_logit);
    }
  });
  return {nll, top, finite};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_nll", &row_nll, "per bfloat16 logits row: its target's NLL, its k largest recomputed in float32");
}
