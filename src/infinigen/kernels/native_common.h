// What the native kernels share (native_build copies it beside each kernel's source and keys every build by it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace infinigen_native {

// exp(x) for x <= 0 in a form the compiler vectorizes (no call, no branch): Cephes' expf polynomial on
// x - n ln 2, times 2^n built in the exponent bits; within 2 ulp of expf; 0 below -87.3 (where float32 turns
// subnormal).
inline float exp_nonpositive(float x) {
  const float below = x < -87.3f ? 0.f : 1.f;
  x = x > -87.3f ? x : -87.3f;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale * below;
}

// Where each (batch row, KV head)'s packed rows start in its batch row (`starts`, [b * hkv]) from the kept counts
// [b, hkv]; returns the longest batch row's number of packed rows.
inline int64_t packed_starts(const int64_t* counts_p, int64_t b, int64_t hkv, std::vector<int64_t>& starts) {
  starts.assign(b * hkv, 0);
  int64_t m = 0;
  for (int64_t bi = 0; bi < b; ++bi) {
    int64_t at = 0;
    for (int64_t kh = 0; kh < hkv; ++kh) {
      starts[bi * hkv + kh] = at;
      at += counts_p[bi * hkv + kh];
    }
    m = std::max(m, at);
  }
  return m;
}

// One query head's scores `row` [n] scaled by `sc` in place (as torch rounds the scaled score); returns their max.
inline float scaled_max(float* row, int64_t n, float sc) {
  for (int64_t j = 0; j < n; ++j) row[j] = row[j] * sc;
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = mx > row[j] ? mx : row[j];
  return mx;
}

// One query head's scaled scores `row` [n] made exp(score - mx) in place, `mx` first clamped as `choose` clamps the
// max; the group's largest relative score `gm` [n] raised to them. Returns the sum of the exponentials.
inline float exp_relative(float* row, int64_t n, float& mx, float* gm) {
  mx = std::max(mx, std::numeric_limits<float>::lowest());
  const float m = mx;
#pragma omp simd  // gm and row never overlap: without the pragma the compiler keeps this loop scalar
  for (int64_t j = 0; j < n; ++j) {  // one pass over the row for both
    const float r = row[j] - m;
    gm[j] = gm[j] < r ? r : gm[j];  // std::max(gm, r), NaN included
    row[j] = exp_nonpositive(r);
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += row[j];
  return sum;
}

// The log-sum-exp of the mass one (batch row, KV head) leaves unread, per query head: `e` [g, n] its scores'
// exp(score - the head's max), `head_max` [g] those maxima, `kp` [n] the kept slots; `unread` a scratch row of n.
inline void unread_lse(const bool* kp, const float* e, const float* head_max, float* lse, int64_t g, int64_t n,
                       std::vector<float>& unread) {
  unread.resize(n);
  float* un = unread.data();
  const uint8_t* kb = reinterpret_cast<const uint8_t*>(kp);  // a bool is the byte 0 or 1
#pragma omp simd  // branch-free (a branch per slot mispredicts on a selection's scattered marks)
  for (int64_t j = 0; j < n; ++j) un[j] = static_cast<float>(1 - kb[j]);
  const float* u = unread.data();
  for (int64_t h = 0; h < g; ++h) {
    const float* eh = e + h * n;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) sum += eh[j] * u[j];
    lse[h] = sum > 0.f ? head_max[h] + std::log(sum) : -std::numeric_limits<float>::infinity();
  }
}

}  // namespace infinigen_native
