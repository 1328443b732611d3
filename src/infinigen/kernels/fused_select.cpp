// Attention of one decoding token per (batch row, KV head) over the rows a selection packs
// (KVStore.select_rows): each chosen key and value row is read once from the store, converted to float32
// once, and used by every query head of its KV head; the softmax is computed online in blocks, so nothing
// [B, H, S]-sized is built. Returns the output, the log-sum-exp of the scaled scores (for the remainder) and
// the float32 sum of the past values read (the token's own row excluded). And, in front of it, the selection
// that packs those rows from a layer's speculated scores (`select_packed`).
#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include "native_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using infinigen_native::exp_nonpositive;
using infinigen_native::packed_starts;
using infinigen_native::exp_relative;
using infinigen_native::scaled_max;
using infinigen_native::unread_lse;

// A new CPU tensor of these kernels' outputs, allocated without a dispatch (`at::detail::empty_cpu`): a selecting
// layer of a decoding step makes eight, which as dispatched `empty` calls were most of the operators its step
// dispatched.
torch::Tensor new_cpu(at::IntArrayRef sizes, at::ScalarType dtype) {
  return torch::Tensor(at::detail::empty_cpu(sizes, dtype, false, std::nullopt));
}

constexpr int64_t kBlock = 32;  // rows per online-softmax block: their keys and values fit in L1 at d <= 128


template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is float32's upper half: a shift, which vectorizes (c10's conversion call does not)
inline void to_float(const c10::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &wide, sizeof(float));
  }
}

// x rounded to bfloat16 and widened again, as c10::BFloat16(x) rounds it (to nearest, ties to even; NaN stays a
// NaN), in a form the compiler vectorizes (c10's conversion has a branch per value)
inline float bf16_round(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return x != x ? x : rounded;
}

// One task's float32 work space, allocated once per task and reused by each part of a run it attends.
struct Workspace {
  std::vector<float> qf, kb, vb, p;
  Workspace(int64_t g, int64_t d) : qf(g * d), kb(kBlock * d), vb(kBlock * d), p(g * kBlock) {}
};

// One part of a (batch row, KV head)'s run: `count` past rows, then the token's own row where own >= 0. Leaves
// the part's online-softmax state: acc [g, d] (weighted values, not yet divided), m [g] (the largest scaled
// score, -inf where nothing was read), l [g] (the weights' sum relative to m) and read_sum [d] (past rows).
template <typename scalar_t>
void attend_part(const scalar_t* q, const scalar_t* keys, const scalar_t* values, const int64_t* rows,
                 int64_t count, int64_t own, int64_t g, int64_t d, float scale, float* acc, float* m, float* l,
                 float* read_sum, Workspace& ws) {
  float* qf = ws.qf.data();
  float* kb = ws.kb.data();
  float* vb = ws.vb.data();
  to_float(q, qf, g * d);
  std::fill(acc, acc + g * d, 0.f);
  std::fill(m, m + g, -std::numeric_limits<float>::infinity());
  std::fill(l, l + g, 0.f);
  std::fill(read_sum, read_sum + d, 0.f);
  const int64_t total = count + (own >= 0 ? 1 : 0);  // the past rows, then the token's own row
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t start = 0; start < total; start += kBlock) {
    const int64_t n = std::min(kBlock, total - start);
    // the next block's rows asked of memory now: scattered rows defeat the hardware prefetcher, and a row
    // waited for one at a time leaves the memory bus idle
    for (int64_t i = start == 0 ? 0 : start + kBlock; i < std::min(start + 2 * kBlock, count); ++i) {
      const char* kr = reinterpret_cast<const char*>(keys + rows[i] * d);
      const char* vr = reinterpret_cast<const char*>(values + rows[i] * d);
      for (int64_t off = 0; off < row_bytes; off += 64) {
        __builtin_prefetch(kr + off);
        __builtin_prefetch(vr + off);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = start + j;
      const int64_t row = i < count ? rows[i] : own;
      to_float(keys + row * d, kb + j * d, d);
      to_float(values + row * d, vb + j * d, d);
      if (i < count) {
        const float* vr = vb + j * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) read_sum[c] += vr[c];
      }
    }
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = qf + h * d;
      float* ph = ws.p.data() + h * kBlock;
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = kb + j * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)  // a vectorized dot product (lanes summed at the end)
        for (int64_t c = 0; c < d; ++c) s += qh[c] * kr[c];
        ph[j] = s * scale;
      }
      float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
      for (int64_t j = 0; j < n; ++j) block_max = block_max > ph[j] ? block_max : ph[j];
      const float m_new = std::max(m[h], block_max);
      const float correction = std::exp(m[h] - m_new);  // exp(-inf) = 0 on the first block
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) ph[j] = exp_nonpositive(ph[j] - m_new);
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) sum += ph[j];
      l[h] = l[h] * correction + sum;
      m[h] = m_new;
      float* ah = acc + h * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) ah[c] *= correction;
      for (int64_t j = 0; j < n; ++j) {
        const float w = ph[j];
        const float* vr = vb + j * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) ah[c] += w * vr[c];
      }
    }
  }
}

// A run's parts merged in order (the log-sum-exp rule: each part's sums rescaled to the largest max), then
// normalized: out [g, d], lse [g], read_sum [d]. One part: its own numbers (each factor is exp(0) = 1).
// With a remainder (r_lse [g]: the unread past entries' log-mass per query head; r_sum [d]: the sum of every
// cached value; unread: how many cached entries were not read), each head's output, rounded to scalar_t as
// attention returns it, is mixed with the unread entries' mean value by their share of the mass, as
// `runtime.attention.with_remainder` does: o + w (mean - o), w = sigmoid(lse_unread - lse_read).
template <typename scalar_t>
void merge_parts(const float* acc, const float* m, const float* l, const float* sums, int64_t parts, int64_t g,
                 int64_t d, scalar_t* out, float* lse, float* read_sum, float* merged, const float* r_lse,
                 const float* r_sum, int64_t unread) {
  std::copy(sums, sums + d, read_sum);
  for (int64_t t = 1; t < parts; ++t)
    for (int64_t c = 0; c < d; ++c) read_sum[c] += sums[t * d + c];
  for (int64_t h = 0; h < g; ++h) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < parts; ++t) top = std::max(top, m[t * g + h]);
    float total = 0.f;
    std::fill(merged, merged + d, 0.f);
    if (top > -std::numeric_limits<float>::infinity()) {
      for (int64_t t = 0; t < parts; ++t) {
        const float factor = std::exp(m[t * g + h] - top);  // 0 for a part that read nothing
        total += l[t * g + h] * factor;
        const float* a = acc + (t * g + h) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) merged[c] += a[c] * factor;
      }
    }
    const bool any = total > 0.f;
    lse[h] = any ? top + std::log(total) : -std::numeric_limits<float>::infinity();
    const float inv = any ? 1.f / total : 0.f;
    if (r_lse == nullptr) {
      for (int64_t c = 0; c < d; ++c) out[h * d + c] = static_cast<scalar_t>(merged[c] * inv);
      continue;
    }
    const float lse_unread = unread > 0 ? r_lse[h] : -std::numeric_limits<float>::infinity();
    const float w = 1.f / (1.f + std::exp(lse[h] - lse_unread));  // exp(u) / (exp(u) + exp(read))
    const float count = static_cast<float>(std::max<int64_t>(unread, 1));
    for (int64_t c = 0; c < d; ++c) {
      const float o = static_cast<float>(static_cast<scalar_t>(merged[c] * inv));
      const float mean = (r_sum[c] - read_sum[c]) / count;
      out[h * d + c] = static_cast<scalar_t>(o + w * (mean - o));
    }
  }
}

}  // namespace

// q [B, H, d] (or [B, H, 1, d]: out then too); keys, values [N, d] (a layer's flat store); rows [B, n] int64, each
// batch row's selected rows head-major (KV head 0's run first); counts [B, Hkv] int64, the length of each run; own [B, Hkv] int64, the
// token's own row (read last), or an empty tensor for none; part_rows: the most rows one task reads of a run (its
// parts merged by log-sum-exp); r_lse [B, H], r_sums [B, Hkv, d] float32 and r_counts [B, Hkv] int64: a remainder
// to mix in (`merge_parts`; the unread entries are every cached one, r_counts of them summing to r_sums, less
// those read), or empty tensors for none. Returns out [B, H, d] (q's dtype), lse [B, H] and read_sum [B, Hkv, d]
// (float32): the log-sum-exp and the past values' sum of what was read.
std::vector<torch::Tensor> attend_rows(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                       torch::Tensor rows, torch::Tensor counts, torch::Tensor own,
                                       double scale, int64_t part_rows, torch::Tensor r_lse, torch::Tensor r_sums,
                                       torch::Tensor r_counts) {
  TORCH_CHECK((q.dim() == 3 || (q.dim() == 4 && q.size(2) == 1)) && keys.dim() == 2 && values.dim() == 2,
              "q [B,H,d] or [B,H,1,d], keys/values [N,d]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "q, keys and values must share a dtype");
  TORCH_CHECK(q.is_cpu() && keys.is_cpu() && values.is_cpu(), "CPU tensors (CUDA's run the Triton kernel)");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && counts.scalar_type() == torch::kLong, "int64 indices");
  q = q.contiguous();
  keys = keys.contiguous();
  values = values.contiguous();
  rows = rows.contiguous();
  counts = counts.contiguous();
  const int64_t b = q.size(0), h = q.size(1), d = q.size(-1), hkv = counts.size(1), g = h / hkv;
  TORCH_CHECK(h % hkv == 0 && keys.size(1) == d && values.size(1) == d, "shapes do not match");
  TORCH_CHECK(rows.size(0) == b && counts.size(0) == b, "batch sizes do not match");
  const bool has_own = own.numel() > 0;
  if (has_own) {
    TORCH_CHECK(own.scalar_type() == torch::kLong && own.size(0) == b && own.size(1) == hkv, "own [B,Hkv]");
    own = own.contiguous();
  }
  const int64_t n = rows.size(1);
  const int64_t* rows_p = rows.data_ptr<int64_t>();
  const int64_t* counts_p = counts.data_ptr<int64_t>();
  const int64_t* own_p = has_own ? own.data_ptr<int64_t>() : nullptr;
  // each batch row's runs start at the running sum of its counts; every index is checked before the work
  const int64_t stored = keys.size(0);
  std::vector<int64_t> starts(b * hkv);
  for (int64_t bi = 0; bi < b; ++bi) {
    int64_t at = 0;
    for (int64_t kh = 0; kh < hkv; ++kh) {
      const int64_t c = counts_p[bi * hkv + kh];
      TORCH_CHECK(c >= 0 && at + c <= n, "counts exceed the packed rows");
      starts[bi * hkv + kh] = at;
      at += c;
      TORCH_CHECK(!has_own || (own_p[bi * hkv + kh] >= 0 && own_p[bi * hkv + kh] < stored), "own row out of range");
    }
    for (int64_t i = 0; i < at; ++i) {
      const int64_t r = rows_p[bi * n + i];
      TORCH_CHECK(r >= 0 && r < stored, "row out of range");
    }
  }
  TORCH_CHECK(values.size(0) == stored, "keys and values differ in rows");
  const bool mixes = r_lse.numel() > 0;
  if (mixes) {
    TORCH_CHECK(r_lse.scalar_type() == torch::kFloat && r_lse.numel() == b * h, "remainder lse [B,Hkv,G] float32");
    TORCH_CHECK(r_sums.scalar_type() == torch::kFloat && r_sums.numel() == b * hkv * d, "remainder sums [B,Hkv,d]");
    TORCH_CHECK(r_counts.scalar_type() == torch::kLong && r_counts.numel() == b * hkv, "remainder counts [B,Hkv]");
    r_lse = r_lse.contiguous();
    r_sums = r_sums.contiguous();
    r_counts = r_counts.contiguous();
  }
  const float* r_lse_p = mixes ? r_lse.data_ptr<float>() : nullptr;
  const float* r_sums_p = mixes ? r_sums.data_ptr<float>() : nullptr;
  const int64_t* r_counts_p = mixes ? r_counts.data_ptr<int64_t>() : nullptr;
  auto out = new_cpu(q.sizes(), q.scalar_type());  // q's shape: [B, H, d] or [B, H, 1, d]
  auto lse = new_cpu({b, h}, torch::kFloat);
  auto read_sum = new_cpu({b, hkv, d}, torch::kFloat);
  // each run cut into parts of at most `part_rows` rows (its own row in the last), so that a few long runs (one
  // batch row, three KV heads) keep every thread busy; the parts depend on the counts alone, never on the batch
  // or the threads, so a run's numbers are the same whatever runs beside it
  const int64_t per_part = std::max<int64_t>(1, part_rows);
  std::vector<int64_t> first_part(b * hkv + 1);
  for (int64_t bh = 0; bh < b * hkv; ++bh) {
    const int64_t total = counts_p[bh] + (has_own ? 1 : 0);
    first_part[bh + 1] = first_part[bh] + std::max<int64_t>(1, (total + per_part - 1) / per_part);
  }
  const int64_t parts = first_part[b * hkv];
  std::vector<int64_t> part_run(parts);
  for (int64_t bh = 0; bh < b * hkv; ++bh)
    std::fill(part_run.begin() + first_part[bh], part_run.begin() + first_part[bh + 1], bh);
  std::vector<float> acc(parts * g * d), mx(parts * g), l(parts * g), sums(parts * d);
  const int64_t* starts_p = starts.data();
  float* lse_p = lse.data_ptr<float>();
  float* sum_p = read_sum.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attend_rows", [&] {
    const scalar_t* q_p = q.data_ptr<scalar_t>();
    const scalar_t* k_p = keys.data_ptr<scalar_t>();
    const scalar_t* v_p = values.data_ptr<scalar_t>();
    scalar_t* out_p = out.data_ptr<scalar_t>();
    at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
      Workspace ws(g, d);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bh = part_run[t], bi = bh / hkv, count = counts_p[bh];
        const int64_t from = (t - first_part[bh]) * per_part;  // in the run's rows, its own row last
        const int64_t to = std::min(from + per_part, count + (has_own ? 1 : 0));
        const int64_t past_to = std::min(to, count);
        const int64_t own_row = has_own && to > count ? own_p[bh] : -1;
        attend_part<scalar_t>(q_p + bh * g * d, k_p, v_p, rows_p + bi * n + starts_p[bh] + from,
                              std::max<int64_t>(0, past_to - from), own_row, g, d, sc, acc.data() + t * g * d,
                              mx.data() + t * g, l.data() + t * g, sums.data() + t * d, ws);
      }
    });
    at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> merged(d);
      for (int64_t bh = lo; bh < hi; ++bh) {
        const int64_t t = first_part[bh];
        merge_parts<scalar_t>(acc.data() + t * g * d, mx.data() + t * g, l.data() + t * g, sums.data() + t * d,
                              first_part[bh + 1] - t, g, d, out_p + bh * g * d, lse_p + bh * g, sum_p + bh * d,
                              merged.data(), mixes ? r_lse_p + bh * g : nullptr,
                              mixes ? r_sums_p + bh * d : nullptr, mixes ? r_counts_p[bh] - counts_p[bh] : 0);
      }
    });
  });
  return {out, lse, read_sum};
}

namespace {

struct Candidate {  // one kept (KV head, slot) of a batch row over its layer cap
  float mass;
  int64_t index;  // KV head * n + slot
};

// The cap's order: more mass first; equal mass, the lower (KV head, slot) first.
inline bool before(const Candidate& a, const Candidate& b) {
  return a.mass > b.mass || (a.mass == b.mass && a.index < b.index);
}

// The kept pairs i of `pairs` whose mass reaches `floor` appended to `cand` in ascending i: sixteen pairs tested at
// once, only the few that pass written (a pair's write waiting on the previous count made the scalar form slow).
inline void candidates_from(const bool* keep, const float* mass, int64_t pairs, float floor,
                            std::vector<Candidate>& cand) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512 lowest = _mm512_set1_ps(floor);
  for (; i + 16 <= pairs; i += 16) {
    const __m128i marks = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + i));
    const __m512 ms = _mm512_loadu_ps(mass + i);
    uint32_t take = _mm_test_epi8_mask(marks, marks) & _mm512_cmp_ps_mask(ms, lowest, _CMP_GE_OQ);
    for (; take != 0; take &= take - 1) {
      const int64_t at = i + __builtin_ctz(take);
      cand.push_back({mass[at], at});
    }
  }
#endif
  for (; i < pairs; ++i)
    if (keep[i] && mass[i] >= floor) cand.push_back({mass[i], i});
}

constexpr int64_t kSampleStride = 8;  // one pair in this many sampled for the cut's lower bound

// One batch row's kept (KV head, slot) pairs (keep [hkv * n], index kh * n + slot, masses mass [hkv * n]) over its
// cap cut to exactly the `total` first in `before`'s order (more mass first, ties to the lower index). A sample of
// the pairs gives a mass `floor` that about twice `total` pairs reach; where at least `total` do, the total-th pair
// reaches it too, so every pair `before` keeps is among them and the partial selection runs over those alone (the
// same pairs); else over every kept pair.
void cut_to_total(bool* keep, int64_t* counts, const float* mass, int64_t hkv, int64_t n, int64_t total,
                  std::vector<float>& sample, std::vector<Candidate>& cand) {
  const int64_t pairs = hkv * n;
  sample.clear();
  for (int64_t i = 0; i < pairs; i += kSampleStride)
    if (keep[i]) sample.push_back(mass[i]);
  float floor = 0.f;  // every mass is >= 0: a floor of 0 takes every kept pair
  const int64_t rank = 2 * total / kSampleStride;  // the sample's pairs above the floor
  if (rank < static_cast<int64_t>(sample.size())) {
    std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
    floor = sample[rank];
  }
  for (int pass = 0; pass < 2; ++pass) {
    cand.clear();  // its capacity kept from row to row: nothing zeroed or allocated again
    candidates_from(keep, mass, pairs, floor, cand);
    if (static_cast<int64_t>(cand.size()) >= total || floor == 0.f) break;
    floor = 0.f;  // the sample misjudged: every kept pair
  }
  std::nth_element(cand.begin(), cand.begin() + total, cand.end(), before);
  std::fill(keep, keep + pairs, false);  // then the `total` pairs `before` keeps marked again
  std::fill(counts, counts + hkv, int64_t{0});
  for (auto it = cand.begin(); it != cand.begin() + total; ++it) {
    keep[it->index] = true;
    ++counts[it->index / n];
  }
}

}  // namespace

// InfiniGen's "layer" selection of one decoding row per batch row, from its speculated scores to the packed rows
// the attention reads. scores [B, Hkv, G, n] float32, every slot of the store's first n valid (no padding, no
// window); OVERWRITTEN with exp(relative). Per query head relative = s * scale - max; a slot is kept when its
// group's largest relative exceeds -alpha; a batch row keeping more than `total` (KV head, slot) pairs keeps
// exactly the `total` with the most mass (the sum over the group of exp(relative) / sum over the slots of
// exp(relative)), ties to the lower (KV head, slot). Returns keep [B, Hkv, n] bool; rows [B, m] int64: each batch
// row's kept rows of the flat [B * Hkv * capacity, d] store, head-major in ascending slots, padded with row 0 to
// the longest batch row's m; head [B, m] int64 (-1 on padding); counts [B, Hkv] int64; and, with with_lse, lse
// [B, Hkv, G] float32: the log-sum-exp of the scaled scores of the slots left unread (-inf where none is, or
// where their mass underflows next to the head's max: each slot below e^-87.3 of it counts 0).
namespace {

// The selection's first pass over one (batch row, KV head): each query head's row of scaled scores (`row` [g, n];
// scaled here unless `maxima` is given, which then holds each head's max of the rows already scaled, as
// `score_select` leaves them), its max, the group's largest relative `gm` [n], exp(relative) in place and its sum;
// keep [n] and the count kept. One simple loop per step, so that each vectorizes (a loop mixing the bool mask with
// floats, or a store with the max, does not). Never inlined: the sums' vectorized order is then this one function's
// whichever call path gets here, so the fused call and the two calls cut alike to the bit.
__attribute__((noinline)) int64_t first_pass(float* rows, int64_t g, int64_t n, float sc, float floor_rel,
                                             const float* maxima, float* gm, float* head_max, float* head_sum,
                                             bool* kp) {
  std::fill(gm, gm + n, -std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < g; ++h) {
    float* row = rows + h * n;
    float mx = maxima == nullptr ? scaled_max(row, n, sc) : maxima[h];
    const float sum = exp_relative(row, n, mx, gm);
    head_max[h] = mx;
    head_sum[h] = sum;
  }
  int64_t c = 0;
  for (int64_t j = 0; j < n; ++j) {
    kp[j] = gm[j] > floor_rel;
    c += kp[j];
  }
  return c;
}

// The flat store rows first + j of the kept slots j (kp [n]) written to out in ascending j; returns their count. out
// holds n + 8: eight candidate rows are stored at once, the count moved past the kept ones.
inline int64_t kept_rows(const bool* kp, int64_t n, int64_t first, int64_t* out) {
  int64_t c = 0, j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512i step = _mm512_set1_epi64(8);
  __m512i rows = _mm512_add_epi64(_mm512_set1_epi64(first), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
  for (; j + 8 <= n; j += 8, rows = _mm512_add_epi64(rows, step)) {
    const __m128i marks = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kp + j));
    const __mmask8 take = static_cast<__mmask8>(_mm_test_epi8_mask(marks, marks));
    _mm512_storeu_si512(out + c, _mm512_maskz_compress_epi64(take, rows));
    c += __builtin_popcount(take);
  }
#endif
  for (; j < n; ++j) {  // branch-free: each slot written, the count moved past the kept ones
    out[c] = first + j;
    c += kp[j];
  }
  return c;
}

// `select_packed` over scores s_p [B, Hkv, G, n] float32 (overwritten), each batch row its own cap: totals[bi]
// (KV head, slot) pairs. maxima [B, Hkv, G]: each head's max where the scores are scaled already (`score_select`),
// or nullptr (scaled here).
std::vector<torch::Tensor> select_from_scores(float* s_p, int64_t b, int64_t hkv, int64_t g, int64_t n,
                                              double scale, double alpha,
                                              const std::vector<int64_t>& totals, int64_t capacity, bool with_lse,
                                              const float* maxima) {
  TORCH_CHECK(static_cast<int64_t>(totals.size()) == b, "one cap per batch row");
  for (const int64_t total : totals) TORCH_CHECK(total >= 0, "the layer cap must be >= 0");
  TORCH_CHECK(capacity >= n, "the store holds fewer slots than the scores cover");
  auto keep = new_cpu({b, hkv, n}, torch::kBool);
  auto counts = new_cpu({b, hkv}, torch::kLong);
  auto lse = new_cpu({b, hkv, with_lse ? g : 0}, torch::kFloat);
  std::vector<float> head_max(b * hkv * g), head_sum(b * hkv * g);
  bool* keep_p = keep.data_ptr<bool>();
  int64_t* counts_p = counts.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale), floor_rel = static_cast<float>(-alpha);
  at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> group_max(n);
    for (int64_t bh = lo; bh < hi; ++bh)
      counts_p[bh] = first_pass(s_p + bh * g * n, g, n, sc, floor_rel, maxima == nullptr ? nullptr : maxima + bh * g,
                                group_max.data(), head_max.data() + bh * g, head_sum.data() + bh * g,
                                keep_p + bh * n);
  });
  // each batch row over its cap keeps exactly its `total` pairs with the most mass (a partial selection); the
  // masses (the same float32 operations whichever thread makes them) of every (batch row, KV head) over its cap
  // made in parallel, so that one batch row's few KV heads keep both threads busy
  std::vector<int64_t> over;
  for (int64_t bi = 0; bi < b; ++bi) {
    int64_t kept = 0;
    for (int64_t kh = 0; kh < hkv; ++kh) kept += counts_p[bi * hkv + kh];
    if (kept > totals[bi]) over.push_back(bi);
  }
  if (!over.empty()) {
    const int64_t heads = static_cast<int64_t>(over.size()) * hkv;
    thread_local std::vector<float> mass;  // reused from call to call: a fresh one faulted its pages in each time
    if (static_cast<int64_t>(mass.size()) < heads * n) mass.resize(heads * n);
    float* mass_p = mass.data();  // this thread's buffer, which the workers' lambdas must not name (their own)
    at::parallel_for(0, heads, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bh = over[t / hkv] * hkv + t % hkv;
        float* ms = mass_p + t * n;
        for (int64_t h = 0; h < g; ++h) {  // as torch: each head's weights, then summed over the group in order
          const float* e = s_p + (bh * g + h) * n;
          const float z = head_sum[bh * g + h];
          if (h == 0) {  // the first head's weights as they are (0 + x is x: the same bits as a sum from 0)
            for (int64_t j = 0; j < n; ++j) ms[j] = e[j] / z;
          } else {
            for (int64_t j = 0; j < n; ++j) ms[j] += e[j] / z;
          }
        }
      }
    });
    at::parallel_for(0, static_cast<int64_t>(over.size()), 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> sample;
      std::vector<Candidate> cand;
      for (int64_t o = lo; o < hi; ++o) {
        const int64_t bi = over[o];
        cut_to_total(keep_p + bi * hkv * n, counts_p + bi * hkv, mass_p + o * hkv * n, hkv, n, totals[bi],
                     sample, cand);
      }
    });
  }
  std::vector<int64_t> starts;
  const int64_t m = packed_starts(counts_p, b, hkv, starts);
  auto rows = new_cpu({b, m}, torch::kLong);
  auto head = new_cpu({b, m}, torch::kLong);
  int64_t* rows_p = rows.data_ptr<int64_t>();
  int64_t* head_p = head.data_ptr<int64_t>();
  for (int64_t bi = 0; bi < b; ++bi) {  // padding after each batch row's last run: row 0, head -1
    const int64_t used = starts[bi * hkv + hkv - 1] + counts_p[bi * hkv + hkv - 1];
    std::fill(rows_p + bi * m + used, rows_p + (bi + 1) * m, int64_t{0});
    std::fill(head_p + bi * m + used, head_p + (bi + 1) * m, int64_t{-1});
  }
  float* lse_p = with_lse ? lse.data_ptr<float>() : nullptr;
  // the packed rows, and the mass each query head leaves unread
  at::parallel_for(0, b * hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> kept(n + 8);  // + 8: `kept_rows` stores whole vectors of eight
    std::vector<float> unread(with_lse ? n : 0);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t bi = bh / hkv, kh = bh % hkv;
      const bool* kp = keep_p + bh * n;
      const int64_t c = kept_rows(kp, n, bh * capacity, kept.data());
      std::copy(kept.begin(), kept.begin() + c, rows_p + bi * m + starts[bh]);
      std::fill(head_p + bi * m + starts[bh], head_p + bi * m + starts[bh] + c, kh);
      if (with_lse) unread_lse(kp, s_p + bh * g * n, head_max.data() + bh * g, lse_p + bh * g, g, n, unread);
    }
  });
  return {keep, rows, head, counts, lse};
}

// `select_from_scores` of a tensor of scores (made contiguous; overwritten).
std::vector<torch::Tensor> select_packed_capped(torch::Tensor scores, double scale, double alpha,
                                                const std::vector<int64_t>& totals, int64_t capacity,
                                                bool with_lse) {
  TORCH_CHECK(scores.dim() == 4 && scores.scalar_type() == torch::kFloat && scores.is_cpu(),
              "scores [B,Hkv,G,n] float32 on the CPU");
  scores = scores.contiguous();
  return select_from_scores(scores.data_ptr<float>(), scores.size(0), scores.size(1), scores.size(2),
                            scores.size(3), scale, alpha, totals, capacity, with_lse, nullptr);
}

}  // namespace

std::vector<torch::Tensor> select_packed(torch::Tensor scores, double scale, double alpha, int64_t total,
                                         int64_t capacity, bool with_lse) {
  TORCH_CHECK(scores.dim() == 4, "scores [B,Hkv,G,n] float32");
  return select_packed_capped(scores, scale, alpha, std::vector<int64_t>(scores.size(0), total), capacity,
                              with_lse);
}

// `select_packed` with one cap per batch row: totals [B] int64. A slot scored -inf is never kept and adds no
// mass (teacher-forced rows of one sequence, each row's slots past its own length set to -inf).
std::vector<torch::Tensor> select_packed_rows(torch::Tensor scores, torch::Tensor totals, double scale,
                                              double alpha, int64_t capacity, bool with_lse) {
  TORCH_CHECK(totals.dim() == 1 && totals.scalar_type() == torch::kLong, "totals [B] int64");
  TORCH_CHECK(scores.dim() == 4 && totals.size(0) == scores.size(0), "one cap per batch row");
  totals = totals.contiguous();
  const int64_t* t = totals.data_ptr<int64_t>();
  return select_packed_capped(scores, scale, alpha, std::vector<int64_t>(t, t + totals.size(0)), capacity,
                              with_lse);
}

namespace {

// A row x [d] of any floating type -> float32 out [d]: x A (A [d, d] row-major float64, a KV head's skew matrix;
// the products and sums in float64, over k in order, rounded to float32 once), or x as float32 where A is null:
// what `policies/speculation.py`'s `rotate` computes with torch's float64 matmul (the same float32 number unless
// the float64 sums differ in their last bit right at a float32 rounding boundary).
// `rotate_sums`: D > 0 is d known when compiled (the sums then stay in registers; the same products and sums).
template <typename scalar_t, int64_t D>
inline void rotate_sums(const scalar_t* x, const double* A, int64_t d, float* out, double* sums) {
  const int64_t n = D > 0 ? D : d;
  std::fill(sums, sums + n, 0.0);
  for (int64_t k = 0; k < n; ++k) {
    const double xk = static_cast<double>(x[k]);
    const double* ak = A + k * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sums[j] += xk * ak[j];
  }
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(sums[j]);
}

template <typename scalar_t>
inline void rotate_row(const scalar_t* x, const double* A, int64_t d, float* out, double* work) {
  if (A == nullptr) {
    for (int64_t k = 0; k < d; ++k) out[k] = static_cast<float>(x[k]);
  } else if (d == 64) {
    double sums[64];
    rotate_sums<scalar_t, 64>(x, A, d, out, sums);
  } else {
    rotate_sums<scalar_t, 0>(x, A, d, out, work);
  }
}

// The n rows of d values of `rows` (contiguous, any floating dtype) rotated by their KV head's matrix (row i's
// head: (i / per_head) % hkv) into float32 out [n, d]; rotation: [Hkv, d, d] float64, or an empty tensor for none.
void rotated_rows(const torch::Tensor& rows, int64_t n, int64_t d, const torch::Tensor& rotation, int64_t hkv,
                  int64_t per_head, float* out) {
  const double* a_p = rotation.numel() > 0 ? rotation.data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "rotated_rows", [&] {
    const scalar_t* x_p = rows.data_ptr<scalar_t>();
    std::vector<double> work(d);
    for (int64_t i = 0; i < n; ++i)
      rotate_row<scalar_t>(x_p + i * d, a_p == nullptr ? nullptr : a_p + (i / per_head) % hkv * d * d, d,
                           out + i * d, work.data());
  });
}

// The rotation's checks: empty, or [Hkv, d, d] float64 (made contiguous).
torch::Tensor checked_rotation(torch::Tensor rotation, int64_t hkv, int64_t d) {
  if (rotation.numel() == 0) return rotation;
  TORCH_CHECK(rotation.scalar_type() == torch::kDouble && rotation.dim() == 3 && rotation.size(0) == hkv &&
              rotation.size(1) == d && rotation.size(2) == d, "rotation [Hkv,d,d] float64");
  return rotation.contiguous();
}

constexpr int64_t kSlotBlock = 64;  // slots per block of the int4 layout: each dim's 32 bytes hold 64 slots' codes

// The scores of G float32 query rows a [G, d] against one 64-slot block of 4-bit keys (codes [d, 32]: dim k's
// byte j holds slot j in its low nibble, slot j + 32 in its high one; sz: the block's first slot of [ng, cap, 2]
// bfloat16 scale-and-zero) -> c [G, 64], in the arithmetic of torch's AVX-512 int4 kernel (`tinygemm_kernel`),
// so the same bits: each key value is fma(code - 8, scale, zero), each score the fma chain over k = 0..d-1 in
// order, rounded to bfloat16 at the end (by the caller).
inline void score_block(const float* a, int64_t g, int64_t d, const uint8_t* codes, const c10::BFloat16* sz,
                        int64_t cap, int64_t group, float* c) {
  alignas(64) float scale[kSlotBlock], zero[kSlotBlock], key[kSlotBlock];
  std::fill(c, c + g * kSlotBlock, 0.f);
  for (int64_t k = 0; k < d; ++k) {
    if (k % group == 0) {
      const c10::BFloat16* part = sz + (k / group) * cap * 2;
      for (int64_t j = 0; j < kSlotBlock; ++j) {
        scale[j] = static_cast<float>(part[2 * j]);
        zero[j] = static_cast<float>(part[2 * j + 1]);
      }
    }
    const uint8_t* byte = codes + k * (kSlotBlock / 2);
#pragma omp simd
    for (int64_t j = 0; j < kSlotBlock / 2; ++j) {
      key[j] = std::fma(static_cast<float>(byte[j] & 15) - 8.f, scale[j], zero[j]);
      key[j + 32] = std::fma(static_cast<float>(byte[j] >> 4) - 8.f, scale[j + 32], zero[j + 32]);
    }
    for (int64_t m = 0; m < g; ++m) {
      const float am = a[m * d + k];
      float* cm = c + m * kSlotBlock;
#pragma omp simd
      for (int64_t j = 0; j < kSlotBlock; ++j) cm[j] = std::fma(am, key[j], cm[j]);
    }
  }
}

#if defined(__AVX512F__)
// `score_block` with G query rows known at compile time, in AVX-512 registers: the same operations on the same
// values (scale and zero are bfloat16 widened by a shift), so the same bits. Each code becomes the float32
// code - 8 (exact) by one table look-up (`vpermps` reads only an index's low 4 bits, so a byte widened to 32 bits
// indexes its low nibble as it is): one shuffle in place of a mask, a conversion and a subtraction, which share
// the floating-point pipes with the FMAs that bound this loop.
template <int G>
inline void score_block_avx512(const float* a, int64_t d, const uint8_t* codes, const c10::BFloat16* sz,
                               int64_t cap, int64_t group, float* c) {
  __m512 acc[G][4];
  for (int m = 0; m < G; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  __m512 scale[4], zero[4];
  const __m512 minus_eight = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f,
                                            5.f, 6.f, 7.f);  // code -> code - 8
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < d; ++k) {
    if (k % group == 0) {  // each slot's (scale, zero) pair is one 32-bit lane: scale in its low half
      const c10::BFloat16* part = sz + (k / group) * cap * 2;
      for (int v = 0; v < 4; ++v) {
        const __m512i pairs = _mm512_loadu_si512(part + 32 * v);
        scale[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        zero[v] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
      }
    }
    const uint8_t* byte = codes + k * (kSlotBlock / 2);
    const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(byte)));
    const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(byte + 16)));
    const __m512i code[4] = {first, second, _mm512_srli_epi32(first, 4), _mm512_srli_epi32(second, 4)};
    __m512 key[4];  // slots 0, 16, 32, 48 on
    for (int v = 0; v < 4; ++v)
      key[v] = _mm512_fmadd_ps(_mm512_permutexvar_ps(code[v], minus_eight), scale[v], zero[v]);
    for (int m = 0; m < G; ++m) {
      const __m512 am = _mm512_set1_ps(a[m * d + k]);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_fmadd_ps(am, key[v], acc[m][v]);
    }
  }
  for (int m = 0; m < G; ++m)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + m * kSlotBlock + 16 * v, acc[m][v]);
}
#endif

// `score_block` by the fastest form this build has for G query rows.
inline void score_block_any(const float* a, int64_t g, int64_t d, const uint8_t* codes, const c10::BFloat16* sz,
                            int64_t cap, int64_t group, float* c) {
#if defined(__AVX512F__)
  switch (g) {
    case 1: return score_block_avx512<1>(a, d, codes, sz, cap, group, c);
    case 2: return score_block_avx512<2>(a, d, codes, sz, cap, group, c);
    case 3: return score_block_avx512<3>(a, d, codes, sz, cap, group, c);
    case 4: return score_block_avx512<4>(a, d, codes, sz, cap, group, c);
    case 5: return score_block_avx512<5>(a, d, codes, sz, cap, group, c);
    case 6: return score_block_avx512<6>(a, d, codes, sz, cap, group, c);
    case 7: return score_block_avx512<7>(a, d, codes, sz, cap, group, c);
    case 8: return score_block_avx512<8>(a, d, codes, sz, cap, group, c);
    default: break;
  }
#endif
  score_block(a, g, d, codes, sz, cap, group, c);
}

}  // namespace

// The checks `score_int4` and `score_select` make of their inputs (q, codes and sz made contiguous in place), and
// every query row rotated once, then rounded to bfloat16 (the int4 kernel's input) and widened again.
static std::vector<float> scoring_queries(torch::Tensor& q, torch::Tensor& codes, torch::Tensor& sz,
                                          int64_t group, int64_t n, torch::Tensor& rotation) {
  TORCH_CHECK(q.dim() == 4 && q.is_floating_point() && q.is_cpu(), "q [B,Hkv,G,d] floating, on the CPU");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == torch::kByte, "codes [B,Hkv,blocks*64,d/2] uint8");
  TORCH_CHECK(sz.dim() == 5 && sz.scalar_type() == at::kBFloat16 && sz.size(4) == 2, "sz [B,Hkv,ng,cap,2] bf16");
  const int64_t b = q.size(0), hkv = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(codes.size(0) == b && codes.size(1) == hkv && codes.size(3) * 2 == d, "codes do not match q");
  TORCH_CHECK(sz.size(0) == b && sz.size(1) == hkv && sz.size(2) * group == d, "sz does not match q");
  TORCH_CHECK(n >= 0 && n <= codes.size(2) && n <= sz.size(3), "n exceeds the packed slots");
  TORCH_CHECK(codes.size(2) % kSlotBlock == 0 && sz.size(3) >= codes.size(2), "codes in whole 64-slot blocks");
  rotation = checked_rotation(rotation, hkv, d);
  q = q.contiguous();
  codes = codes.contiguous();
  sz = sz.contiguous();
  std::vector<float> queries(b * hkv * g * d);
  rotated_rows(q, b * hkv * g, d, rotation, hkv, g, queries.data());
  for (float& x : queries) x = static_cast<float>(c10::BFloat16(x));
  return queries;
}

// The 4-bit keys' scores of one decoding row per (batch row, KV head), in one parallel region: q [B, Hkv, G, d]
// (any floating dtype), rotated by rotation [Hkv, d, d] float64 (`rotate_row`; an empty tensor: not rotated) and
// rounded to bfloat16 as torch's CPU int4 kernel takes its queries; codes [B, Hkv, blocks * 64, d / 2] uint8 and
// sz [B, Hkv, ng, capacity, 2] bfloat16 in that kernel's layout (kernels/int4.py, "tinygemm"). Computed here in
// that kernel's arithmetic (`score_block`), so every score has the bits of its call from Python, without its
// per-call work (a dispatch, a copy of the scale-and-zero, a bfloat16 output converted again); each (batch row,
// KV head)'s blocks in parts of `part_slots` slots, a task each. Returns float32 [B, Hkv, G, n].
torch::Tensor score_int4(torch::Tensor q, torch::Tensor codes, torch::Tensor sz, int64_t group, int64_t n,
                         int64_t part_slots, torch::Tensor rotation) {
  const std::vector<float> queries = scoring_queries(q, codes, sz, group, n, rotation);
  const int64_t b = q.size(0), hkv = q.size(1), g = q.size(2), d = q.size(3);
  auto out = new_cpu({b, hkv, g, n}, torch::kFloat);
  if (n == 0) return out;
  const int64_t blocks = (n + kSlotBlock - 1) / kSlotBlock, cap = sz.size(3), ng = sz.size(2);
  const int64_t per_part = std::max<int64_t>(1, (part_slots + kSlotBlock - 1) / kSlotBlock);  // blocks per task
  const int64_t parts = (blocks + per_part - 1) / per_part;
  const float* q_p = queries.data();
  const uint8_t* codes_p = codes.data_ptr<uint8_t>();
  const c10::BFloat16* sz_p = sz.data_ptr<c10::BFloat16>();
  float* out_p = out.data_ptr<float>();
  const int64_t head_codes = codes.size(2) * d / 2;  // bytes of one (batch row, KV head)
  at::parallel_for(0, b * hkv * parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(g * kSlotBlock);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t bh = t / parts, first = t % parts * per_part, last = std::min(blocks, first + per_part);
      const float* a = q_p + bh * g * d;
      for (int64_t blk = first; blk < last; ++blk) {
        score_block_any(a, g, d, codes_p + bh * head_codes + blk * kSlotBlock * d / 2,
                    sz_p + bh * ng * cap * 2 + blk * kSlotBlock * 2, cap, group, c.data());
        const int64_t used = std::min(kSlotBlock, n - blk * kSlotBlock);
        for (int64_t m = 0; m < g; ++m) {  // rounded to bfloat16, as the kernel returns its scores
          float* dst = out_p + (bh * g + m) * n + blk * kSlotBlock;
          const float* cm = c.data() + m * kSlotBlock;
#pragma omp simd
          for (int64_t j = 0; j < used; ++j) dst[j] = bf16_round(cm[j]);
        }
      }
    }
  });
  return out;
}

// `score_int4` and `select_packed` in one call: the same scores (the same bits) computed in the same tasks, each
// multiplied by `scale` and its query head's max kept per task as it is written (the selection's first pass, while
// the scores are in cache), then the same selection from them (`select_from_scores`: its rows equal the two
// calls' to the bit). The scores live in a buffer of this thread reused from call to call: no [B, Hkv, G, n]
// tensor is made. Returns what `select_packed` returns.
std::vector<torch::Tensor> score_select(torch::Tensor q, torch::Tensor codes, torch::Tensor sz, int64_t group,
                                        int64_t n, int64_t part_slots, torch::Tensor rotation, double scale,
                                        double alpha, int64_t total, int64_t capacity, bool with_lse) {
  const std::vector<float> queries = scoring_queries(q, codes, sz, group, n, rotation);
  const int64_t b = q.size(0), hkv = q.size(1), g = q.size(2), d = q.size(3);
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < b * hkv * g * n) buffer.resize(b * hkv * g * n);
  float* out_p = buffer.data();
  const int64_t blocks = (n + kSlotBlock - 1) / kSlotBlock, cap = sz.size(3), ng = sz.size(2);
  const int64_t per_part = std::max<int64_t>(1, (part_slots + kSlotBlock - 1) / kSlotBlock);
  const int64_t parts = (blocks + per_part - 1) / per_part;
  std::vector<float> part_max(b * hkv * parts * g, -std::numeric_limits<float>::infinity());
  const float sc = static_cast<float>(scale);
  const float* q_p = queries.data();
  const uint8_t* codes_p = codes.data_ptr<uint8_t>();
  const c10::BFloat16* sz_p = sz.data_ptr<c10::BFloat16>();
  const int64_t head_codes = codes.size(2) * d / 2;
  at::parallel_for(0, b * hkv * parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(g * kSlotBlock);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t bh = t / parts, first = t % parts * per_part, last = std::min(blocks, first + per_part);
      const float* a = q_p + bh * g * d;
      float* top = part_max.data() + t * g;
      for (int64_t blk = first; blk < last; ++blk) {
        score_block_any(a, g, d, codes_p + bh * head_codes + blk * kSlotBlock * d / 2,
                        sz_p + bh * ng * cap * 2 + blk * kSlotBlock * 2, cap, group, c.data());
        const int64_t used = std::min(kSlotBlock, n - blk * kSlotBlock);
        for (int64_t m = 0; m < g; ++m) {  // rounded to bfloat16 as `score_int4` returns it, then scaled
          float* dst = out_p + (bh * g + m) * n + blk * kSlotBlock;
          const float* cm = c.data() + m * kSlotBlock;
#pragma omp simd
          for (int64_t j = 0; j < used; ++j) dst[j] = bf16_round(cm[j]) * sc;
          float mx = top[m];
#pragma omp simd reduction(max : mx)
          for (int64_t j = 0; j < used; ++j) mx = mx > dst[j] ? mx : dst[j];
          top[m] = mx;
        }
      }
    }
  });
  std::vector<float> maxima(b * hkv * g, -std::numeric_limits<float>::infinity());
  for (int64_t bh = 0; bh < b * hkv; ++bh)
    for (int64_t t = 0; t < parts; ++t)
      for (int64_t m = 0; m < g; ++m)
        maxima[bh * g + m] = std::max(maxima[bh * g + m], part_max[(bh * parts + t) * g + m]);
  return select_from_scores(out_p, b, hkv, g, n, scale, alpha, std::vector<int64_t>(b, total),
                            capacity, with_lse, maxima.data());
}

// A rotated key x [d] float32 quantized to 4 bits and written at `slot` of one (batch row, KV head) of the int4
// kernel's layout: `column` its codes' block (dim k's byte at column[k * 32], slot % 32 of the block; the low
// nibble for slot % 64 < 32), `sz` the (batch row, KV head)'s [ng, cap, 2] bfloat16 scale-and-zero. The arithmetic
// of `int4._quantize_tinygemm` step by step in float32 (the same codes, scale and zero to the bit): scale =
// max((max - min) / 15, tiny) and zero = min + 8 * scale, each rounded to bfloat16; code =
// round-half-even((x - (zero - 8 * scale)) / scale), clamped to 0..15.
inline void put_int4(const float* x_row, int64_t slot, int64_t d, int64_t group, int64_t cap, uint8_t* column,
                     c10::BFloat16* sz) {
  const bool high = slot % 64 >= 32;
  for (int64_t gi = 0; gi < d / group; ++gi) {
    const float* x = x_row + gi * group;
    float lo = x[0], hi = x[0];
    for (int64_t k = 1; k < group; ++k) {
      lo = std::min(lo, x[k]);
      hi = std::max(hi, x[k]);
    }
    float scale = (hi - lo) / 15.f;
    scale = scale < std::numeric_limits<float>::min() ? std::numeric_limits<float>::min() : scale;
    const c10::BFloat16 scale16(scale);
    const float scale_f = static_cast<float>(scale16);
    const float eight_scales = 8.f * scale_f;  // exact: a power of two times a bfloat16
    const c10::BFloat16 zero16(lo + eight_scales);
    const float base = static_cast<float>(zero16) - eight_scales;
    c10::BFloat16* out = sz + (gi * cap + slot) * 2;
    out[0] = scale16;
    out[1] = zero16;
    for (int64_t k = 0; k < group; ++k) {
      const float code = std::min(std::max(std::nearbyint((x[k] - base) / scale_f), 0.f), 15.f);
      uint8_t& byte = column[(gi * group + k) * 32];
      const uint8_t c = static_cast<uint8_t>(code);
      byte = high ? static_cast<uint8_t>((byte & 0x0F) | (c << 4)) : static_cast<uint8_t>((byte & 0xF0) | c);
    }
  }
}

// The int4 layout's checks: codes [B, Hkv, blocks, d, 32] uint8 and sz [B, Hkv, ng, capacity, 2] bfloat16, both
// contiguous, the group dividing d.
void check_int4_layout(const torch::Tensor& codes, const torch::Tensor& sz, int64_t group) {
  TORCH_CHECK(codes.dim() == 5 && codes.scalar_type() == torch::kByte && codes.is_contiguous() &&
              codes.size(4) == 32, "codes [B,Hkv,blocks,d,32] uint8, contiguous");
  TORCH_CHECK(sz.dim() == 5 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.size(4) == 2,
              "sz [B,Hkv,ng,capacity,2] bfloat16, contiguous");
  TORCH_CHECK(group > 0 && sz.size(2) * group == codes.size(3), "the group does not divide d");
  TORCH_CHECK(sz.size(0) == codes.size(0) && sz.size(1) == codes.size(1), "shapes do not match");
}

// One decoding token's key per (batch row, KV head), rows [B, Hkv, 1, d] (any floating dtype; rotated by rotation
// [Hkv, d, d] float64 as `rotate_row` does, or taken as float32 where rotation is empty), quantized to 4 bits
// (`put_int4`) and written into its slot (slots [B, Hkv]) of the int4 kernel's layout in place.
void scatter_int4(torch::Tensor codes, torch::Tensor sz, torch::Tensor slots, torch::Tensor rows, int64_t group,
                  torch::Tensor rotation) {
  check_int4_layout(codes, sz, group);
  TORCH_CHECK(rows.dim() == 4 && rows.size(2) == 1 && rows.is_floating_point(), "rows [B,Hkv,1,d] floating");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == torch::kLong, "slots [B,Hkv] int64");
  const int64_t b = codes.size(0), hkv = codes.size(1), blocks = codes.size(2), d = codes.size(3);
  const int64_t cap = sz.size(3), ng = sz.size(2);
  TORCH_CHECK(rows.size(0) == b && rows.size(1) == hkv && rows.size(3) == d && slots.size(0) == b &&
              slots.size(1) == hkv, "shapes do not match");
  rows = rows.contiguous();
  slots = slots.contiguous();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  for (int64_t bh = 0; bh < b * hkv; ++bh)
    TORCH_CHECK(slot_p[bh] >= 0 && slot_p[bh] < cap && slot_p[bh] < blocks * 64, "slot out of range");
  rotation = checked_rotation(rotation, hkv, d);
  std::vector<float> rotated(b * hkv * d);
  rotated_rows(rows, b * hkv, d, rotation, hkv, 1, rotated.data());
  uint8_t* code_p = codes.data_ptr<uint8_t>();
  c10::BFloat16* sz_p = sz.data_ptr<c10::BFloat16>();
  for (int64_t bh = 0; bh < b * hkv; ++bh) {
    const int64_t slot = slot_p[bh];
    put_int4(rotated.data() + bh * d, slot, d, group, cap, code_p + (bh * blocks + slot / 64) * d * 32 + slot % 32,
             sz_p + bh * ng * cap * 2);
  }
}

// A prompt's keys, keys [B, Hkv, T, d] (any floating dtype), rotated (as `scatter_int4`) and quantized into slots
// start .. start+T-1 of every (batch row, KV head) of the int4 layout in place: what T calls of `scatter_int4`
// write, one call. In parallel over (batch row, KV head, 64-slot block): two slots share a byte only within a block.
void write_int4(torch::Tensor codes, torch::Tensor sz, int64_t start, torch::Tensor keys, int64_t group,
                torch::Tensor rotation) {
  check_int4_layout(codes, sz, group);
  TORCH_CHECK(keys.dim() == 4 && keys.is_floating_point(), "keys [B,Hkv,T,d] floating");
  const int64_t b = codes.size(0), hkv = codes.size(1), blocks = codes.size(2), d = codes.size(3);
  const int64_t cap = sz.size(3), ng = sz.size(2), t = keys.size(2);
  TORCH_CHECK(keys.size(0) == b && keys.size(1) == hkv && keys.size(3) == d, "shapes do not match");
  TORCH_CHECK(start >= 0 && start + t <= cap && start + t <= blocks * 64, "slots out of range");
  if (t == 0) return;
  keys = keys.contiguous();
  rotation = checked_rotation(rotation, hkv, d);
  const double* a_p = rotation.numel() > 0 ? rotation.data_ptr<double>() : nullptr;
  uint8_t* code_p = codes.data_ptr<uint8_t>();
  c10::BFloat16* sz_p = sz.data_ptr<c10::BFloat16>();
  const int64_t first = start / 64, spans = (start + t - 1) / 64 - first + 1;  // the 64-slot blocks written
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "write_int4", [&] {
    const scalar_t* k_p = keys.data_ptr<scalar_t>();
    at::parallel_for(0, b * hkv * spans, 1, [&](int64_t lo, int64_t hi) {
      std::vector<double> work(d);
      std::vector<float> row(d);
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t bh = task / spans, block = first + task % spans;
        const double* a = a_p == nullptr ? nullptr : a_p + (bh % hkv) * d * d;
        for (int64_t slot = std::max(start, block * 64); slot < std::min(start + t, (block + 1) * 64); ++slot) {
          rotate_row<scalar_t>(k_p + (bh * t + slot - start) * d, a, d, row.data(), work.data());
          put_int4(row.data(), slot, d, group, cap, code_p + (bh * blocks + block) * d * 32 + slot % 32,
                   sz_p + bh * ng * cap * 2);
        }
      }
    });
  });
}

// One decoding token per (batch row, KV head) stored at `slot` of a layer's store in place, as `KVStore.append`'s
// copies store it: keys, values [B, Hkv, capacity, d] (contiguous) get k, v [B, Hkv, 1, d] (their dtype), valid
// [B, Hkv, capacity] bool is set and pos [B, Hkv, capacity] int64 gets positions [B]. One call for what is ten
// operator calls from Python.
void append_token(torch::Tensor keys, torch::Tensor values, torch::Tensor valid, torch::Tensor pos, int64_t slot,
                  torch::Tensor k, torch::Tensor v, torch::Tensor positions) {
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && valid.is_contiguous() &&
              pos.is_contiguous(), "the store's tensors must be contiguous");
  const int64_t b = keys.size(0), hkv = keys.size(1), cap = keys.size(2), d = keys.size(3);
  TORCH_CHECK(values.sizes() == keys.sizes() && k.scalar_type() == keys.scalar_type() &&
              v.scalar_type() == values.scalar_type(), "k, v must have the store's dtype");
  TORCH_CHECK(k.dim() == 4 && k.size(0) == b && k.size(1) == hkv && k.size(2) == 1 && k.size(3) == d &&
              v.sizes() == k.sizes(), "k, v [B,Hkv,1,d]");
  TORCH_CHECK(valid.scalar_type() == torch::kBool && pos.scalar_type() == torch::kLong &&
              valid.numel() == b * hkv * cap && pos.numel() == b * hkv * cap, "valid, pos [B,Hkv,capacity]");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.numel() == b, "positions [B] int64");
  TORCH_CHECK(slot >= 0 && slot < cap, "slot out of range");
  k = k.contiguous();
  v = v.contiguous();
  positions = positions.contiguous();
  const int64_t row = d * keys.element_size();
  char* k_p = static_cast<char*>(keys.data_ptr());
  char* v_p = static_cast<char*>(values.data_ptr());
  const char* kt = static_cast<const char*>(k.data_ptr());
  const char* vt = static_cast<const char*>(v.data_ptr());
  bool* valid_p = valid.data_ptr<bool>();
  int64_t* pos_p = pos.data_ptr<int64_t>();
  const int64_t* at = positions.data_ptr<int64_t>();
  for (int64_t bh = 0; bh < b * hkv; ++bh) {
    std::memcpy(k_p + (bh * cap + slot) * row, kt + bh * row, row);
    std::memcpy(v_p + (bh * cap + slot) * row, vt + bh * row, row);
    valid_p[bh * cap + slot] = true;
    pos_p[bh * cap + slot] = at[bh / hkv];
  }
}

// A layer's running float32 sums [B, Hkv, d] and counts [B, Hkv] of its stored values (InfiniGen's remainder)
// advanced by one decoding token's values v [B, Hkv, 1, d] (any floating dtype, any strides), in place: each value
// widened to float32 and added once, as torch's in-place add of v into the sums computes it (the same bits), and
// each count by one, in one call instead of two dispatched adds.
void add_values(torch::Tensor sums, torch::Tensor counts, torch::Tensor v) {
  TORCH_CHECK(sums.dim() == 3 && sums.scalar_type() == torch::kFloat && sums.is_contiguous() && sums.is_cpu(),
              "sums [B,Hkv,d] float32, contiguous, on the CPU");
  const int64_t b = sums.size(0), hkv = sums.size(1), d = sums.size(2);
  TORCH_CHECK(counts.scalar_type() == torch::kLong && counts.is_contiguous() && counts.numel() == b * hkv,
              "counts [B,Hkv] int64, contiguous");
  TORCH_CHECK(v.dim() == 4 && v.size(0) == b && v.size(1) == hkv && v.size(2) == 1 && v.size(3) == d && v.is_cpu(),
              "v [B,Hkv,1,d] on the CPU");
  float* s_p = sums.data_ptr<float>();
  int64_t* c_p = counts.data_ptr<int64_t>();
  const int64_t sb = v.stride(0), sh = v.stride(1), sd = v.stride(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "add_values", [&] {
    const scalar_t* v_p = v.data_ptr<scalar_t>();
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t kh = 0; kh < hkv; ++kh) {
        float* s = s_p + (bi * hkv + kh) * d;
        const scalar_t* x = v_p + bi * sb + kh * sh;
        for (int64_t j = 0; j < d; ++j) s[j] += static_cast<float>(x[j * sd]);
        c_p[bi * hkv + kh] += 1;
      }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_values", &add_values, "a decoding token's values added to a layer's running sums and counts");
  m.def("append_token", &append_token, "a decoding token stored at one slot of a layer's store");
  m.def("scatter_int4", &scatter_int4, "a decoding token's key quantized into the int4 kernel's layout");
  m.def("write_int4", &write_int4, "a prompt's keys quantized into the int4 kernel's layout");
  m.def("score_int4", &score_int4, "the int4 speculation keys' scores, one parallel region per layer");
  m.def("score_select", &score_select, "score_int4 and select_packed in one call");
  m.def("attend_rows", &attend_rows, "attention over packed selected rows, online softmax");
  m.def("select_packed", &select_packed, "InfiniGen's layer-capped selection from scores to packed rows");
  m.def("select_packed_rows", &select_packed_rows, "select_packed with one cap per batch row");
}
