// InfiniGen's re-rank (knob `rerank`, kernels/rerank.py): a layer's candidates (`infinigen_rerank.candidates`)
// re-ranked by the exact keys and the layer's own query, in one call: only the candidates' keys are read. What
// `infinigen_rerank.rerank_cut` makes in some forty torch calls.
#include <torch/extension.h>
#include "native_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// log(exp(a) + exp(b)), -inf where both are
inline float log_add(float a, float b) {
  if (a == kNegInf) return b;
  if (b == kNegInf) return a;
  const float m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

constexpr int64_t kLanes = 16;  // partial sums of a dot product, which the compiler keeps in one vector register

// x . y over d floats in kLanes partial sums (a single running sum is a chain of dependent adds, not vectorized)
inline float dot_product(const float* x, const float* y, int64_t d) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[j + l] * y[j + l];
  float dot = 0.f;
  for (; j < d; ++j) dot += x[j] * y[j];
  for (int64_t l = 0; l < kLanes; ++l) dot += lanes[l];
  return dot;
}

// One query head's scores row [count] made exp(score - top) in place, top their largest (clamped to the lowest
// float, as the cut clamps it); returns the sum of the weights. Outside the dtype dispatch: its loops vectorize.
inline float weights_in_place(float* row, int64_t count, float& top) {
  float mx = kNegInf;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < count; ++i) mx = mx > row[i] ? mx : row[i];
  top = std::max(mx, std::numeric_limits<float>::lowest());
  const float m = top;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < count; ++i) {
    row[i] = infinigen_native::exp_nonpositive(row[i] - m);
    sum += row[i];
  }
  return sum;
}

// acc[i] += x[i] * w over count floats
inline void add_scaled(float* acc, const float* x, float w, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) acc[i] += x[i] * w;
}

struct Candidate {
  float mass;
  int64_t index;  // KV head * n + slot
};

// More mass first; equal mass, the lower (KV head, slot) first.
inline bool before(const Candidate& a, const Candidate& b) {
  return a.mass > b.mass || (a.mass == b.mass && a.index < b.index);
}

}  // namespace

// cand [B, Hkv, n] bool: the candidates (the plain cut and the pairs with the most 4-bit mass); q [B, Hkv, G, d]:
// the own query; keys [B, Hkv, >= n, d] (any strides, q's dtype); unread [B, Hkv, G] float32: the 4-bit log-mass of
// the entries that are not candidates; size [B] int64: how many (KV head, slot) pairs each batch row keeps (at most
// its candidates). Each candidate's exact scaled scores q . k * scale; per (batch row, KV head, query head) their
// log-sum-exp with `unread` is the denominator; a candidate's mass is the sum over its group of exp(score -
// denominator); each batch row keeps its `size` candidates with the most mass, ties to the lower (KV head, slot).
// Returns keep [B, Hkv, n] bool; rows [B, m] int64: the kept rows of the flat [B * Hkv * capacity, d] store,
// head-major in ascending slots, padded with row 0 to the longest batch row's m; head [B, m] int64 (-1 on padding);
// counts [B, Hkv] int64; lse [B, Hkv, G] float32: `unread` with the dropped candidates' exact scores added; beside
// [B, Hkv] int64: the candidates not kept (their keys were read to choose).
std::vector<torch::Tensor> rerank_rows(torch::Tensor cand, torch::Tensor q, torch::Tensor keys, torch::Tensor unread,
                                       torch::Tensor size, double scale, int64_t capacity) {
  TORCH_CHECK(cand.dim() == 3 && cand.scalar_type() == at::kBool, "cand must be [B, Hkv, n] bool");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && q.scalar_type() == keys.scalar_type(),
              "q [B, Hkv, G, d] and keys [B, Hkv, S, d] of one dtype");
  const int64_t b = cand.size(0), hkv = cand.size(1), n = cand.size(2), g = q.size(2), d = q.size(3);
  TORCH_CHECK(q.size(0) == b && q.size(1) == hkv && keys.size(0) == b && keys.size(1) == hkv && keys.size(2) >= n &&
                  keys.size(3) == d,
              "q and keys must match cand's batch rows and KV heads, keys hold n slots");
  TORCH_CHECK(unread.scalar_type() == at::kFloat && unread.numel() == b * hkv * g,
              "unread must be [B, Hkv, G] float32");
  TORCH_CHECK(size.scalar_type() == at::kLong && size.numel() == b, "size must be [B] int64");
  TORCH_CHECK(capacity >= n, "capacity must hold n slots");
  const auto c = cand.contiguous();
  const auto un = unread.contiguous();
  const auto sz = size.contiguous();
  const bool* c_p = c.data_ptr<bool>();
  const float* un_p = un.data_ptr<float>();
  const int64_t* sz_p = sz.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);

  // per (batch row, KV head): its candidates' slots; their weights p [G, count] = exp(score - the head's largest);
  // per query head the largest score, the weights' sum and w = exp(largest - denominator), so that a candidate's
  // share of its head's attention is p * w (one exp per candidate and query head)
  std::vector<std::vector<int64_t>> slots(b * hkv);
  std::vector<std::vector<float>> weight(b * hkv);
  std::vector<float> largest(b * hkv * g, kNegInf), share(b * hkv * g, 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rerank_rows", [&] {
    const scalar_t* q_p = q.data_ptr<scalar_t>();
    const scalar_t* k_p = keys.data_ptr<scalar_t>();
    const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
    const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2), ks3 = keys.stride(3);
    at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> qf(g * d), kf(d);
      for (int64_t bh = lo; bh < hi; ++bh) {
        const int64_t bi = bh / hkv, kh = bh % hkv;
        for (int64_t gi = 0; gi < g; ++gi)
          for (int64_t j = 0; j < d; ++j)
            qf[gi * d + j] = static_cast<float>(q_p[bi * qs0 + kh * qs1 + gi * qs2 + j * qs3]);
        auto& sl = slots[bh];
        const bool* mark = c_p + bh * n;
        for (int64_t s = 0; s < n; ++s)
          if (mark[s]) sl.push_back(s);
        const int64_t count = static_cast<int64_t>(sl.size());
        auto& e = weight[bh];  // [G, count]: each query head's scores, then their weights
        e.resize(count * g);
        for (int64_t i = 0; i < count; ++i) {
          const scalar_t* k = k_p + bi * ks0 + kh * ks1 + sl[i] * ks2;
          for (int64_t j = 0; j < d; ++j) kf[j] = static_cast<float>(k[j * ks3]);
          for (int64_t gi = 0; gi < g; ++gi) e[gi * count + i] = dot_product(qf.data() + gi * d, kf.data(), d) * sc;
        }
        float* mx = largest.data() + bh * g;
        float* w = share.data() + bh * g;
        for (int64_t gi = 0; gi < g && count > 0; ++gi) {
          float top;
          const float sum = weights_in_place(e.data() + gi * count, count, top);
          mx[gi] = top;
          w[gi] = std::exp(top - log_add(top + std::log(sum), un_p[bh * g + gi]));
        }
      }
    });
  });

  auto keep = torch::zeros({b, hkv, n}, torch::kBool);
  auto counts = torch::zeros({b, hkv}, torch::kLong);
  auto beside = torch::zeros({b, hkv}, torch::kLong);
  auto lse = un.clone().view({b, hkv, g});
  bool* keep_p = keep.data_ptr<bool>();
  int64_t* counts_p = counts.data_ptr<int64_t>();
  int64_t* beside_p = beside.data_ptr<int64_t>();
  float* lse_p = lse.data_ptr<float>();
  at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
    std::vector<Candidate> all;
    std::vector<float> dropped(g), mass;
    for (int64_t bi = lo; bi < hi; ++bi) {
      all.clear();
      for (int64_t kh = 0; kh < hkv; ++kh) {
        const int64_t bh = bi * hkv + kh;
        const float* p = weight[bh].data();
        const float* w = share.data() + bh * g;
        const int64_t count = static_cast<int64_t>(slots[bh].size());
        mass.assign(count, 0.f);
        for (int64_t gi = 0; gi < g; ++gi) add_scaled(mass.data(), p + gi * count, w[gi], count);
        for (int64_t i = 0; i < count; ++i) all.push_back({mass[i], kh * n + slots[bh][i]});
      }
      const int64_t total = std::min<int64_t>(sz_p[bi], static_cast<int64_t>(all.size()));
      if (total < static_cast<int64_t>(all.size()))
        std::nth_element(all.begin(), all.begin() + total, all.end(), before);
      bool* kp = keep_p + bi * hkv * n;
      for (int64_t i = 0; i < total; ++i) {
        kp[all[i].index] = true;
        ++counts_p[bi * hkv + all[i].index / n];
      }
      for (int64_t kh = 0; kh < hkv; ++kh) {  // the dropped candidates' mass goes to the unread entries'
        const int64_t bh = bi * hkv + kh, count = static_cast<int64_t>(slots[bh].size());
        beside_p[bh] = count - counts_p[bh];
        if (beside_p[bh] == 0) continue;
        std::fill(dropped.begin(), dropped.end(), 0.f);
        const float* p = weight[bh].data();
        for (int64_t i = 0; i < count; ++i)
          if (!kp[kh * n + slots[bh][i]])
            for (int64_t gi = 0; gi < g; ++gi) dropped[gi] += p[gi * count + i];
        for (int64_t gi = 0; gi < g; ++gi)
          if (dropped[gi] > 0.f)
            lse_p[bh * g + gi] = log_add(lse_p[bh * g + gi], largest[bh * g + gi] + std::log(dropped[gi]));
      }
    }
  });

  int64_t m = 0;
  for (int64_t bi = 0; bi < b; ++bi) {
    int64_t kept = 0;
    for (int64_t kh = 0; kh < hkv; ++kh) kept += counts_p[bi * hkv + kh];
    m = std::max(m, kept);
  }
  auto rows = torch::zeros({b, m}, torch::kLong);
  auto head = torch::full({b, m}, -1, torch::kLong);
  int64_t* rows_p = rows.data_ptr<int64_t>();
  int64_t* head_p = head.data_ptr<int64_t>();
  for (int64_t bi = 0; bi < b; ++bi) {
    int64_t at = 0;
    for (int64_t kh = 0; kh < hkv; ++kh) {
      const int64_t bh = bi * hkv + kh;
      for (int64_t s : slots[bh])
        if (keep_p[bh * n + s]) {
          rows_p[bi * m + at] = bh * capacity + s;
          head_p[bi * m + at] = kh;
          ++at;
        }
    }
  }
  return {keep, rows, head, counts, lse, beside};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rerank_rows", &rerank_rows, "InfiniGen's re-rank of a cut's candidates by the exact keys");
}
