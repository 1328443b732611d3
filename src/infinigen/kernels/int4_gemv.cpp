// A few rows of activations times a group-wise 4-bit weight held in torch's AVX-512 CPU int4 layout
// (`_convert_weight_to_int4pack_for_cpu`: blocks of 64 outputs, [K, 32] bytes each, byte j of input k holding
// output j in its low nibble and output j + 32 in its high one; scale-and-zero [K / group, N, 2]), as the op
// `infinigen::int4_gemv`, so a compiled graph calls it like any aten op.
//
// The weight is w = (q - 8) * scale + zero = q * scale + base with base = zero - 8 * scale, so an output is
//   y[n] = sum over groups g of  scale[g, n] * (sum_{k in g} q[k, n] x[k])  +  base[g, n] * (sum_{k in g} x[k])
// (what llama.cpp does per block): a code is never dequantized, each weight costs one multiply-add of its code,
// and the group's scale and base are applied once per group. bfloat16 activations: each 4-bit code becomes the
// bfloat16 of 16 + code (exact, by a shift and a logic op) and `vdpbf16ps` adds (16 + code) * x of two inputs per
// lane (the products are exact in float32; the sums are float32), the group's fold taking 16 * sum(x) back out;
// float32 activations: the codes as float32 and fused multiply-adds. Nothing is quantized that the activations did
// not already hold, and every output is rounded once to x's dtype.
//
// Threads: the tasks are whole blocks (bfloat16: one pass over K gives all 64 outputs) or, for float32, half blocks
// (32 outputs: low nibbles of bytes 16h..16h+15 and their high nibbles) where a block's codes fit in L1, split over
// torch's intra-op threads; a row's arithmetic does not depend on the other rows or the split.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlockN = 64;  // outputs per block of the layout
constexpr int64_t kRowsPerPass = 4;  // activation rows per pass over a block (the accumulators' registers)
constexpr int64_t kMaxRows = 8;
// float32: a block's codes up to this size are read twice (once per half)
constexpr int64_t kBlockBytesInL1 = 24 * 1024;
// how many inputs ahead a block's codes are prefetched (32 bytes each): the codes are one sequential stream,
// but with arithmetic between its loads the hardware alone fetches too little ahead
constexpr int64_t kPrefetchInputs = 128;

#if defined(__AVX512F__)
constexpr bool kFloat32 = true;
#else
constexpr bool kFloat32 = false;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
constexpr bool kBFloat16 = true;
#else
constexpr bool kBFloat16 = false;
#endif

struct Problem {
  int64_t rows, k, n, group, groups;
  const uint8_t* packed;  // [N / 64][K][32]
  const void* x;          // [rows, K]
  const void* sz;         // [groups, N, 2]
  const float* sums;      // [rows, groups]: each group's sum of x, float32 in input order
  void* out;              // [rows, N]
};

#if defined(__AVX512F__)
// A group's scale and base (zero - 8 scale) for 16 outputs from their 16 (scale, zero) pairs
inline void scale_base(const c10::BFloat16* pairs, __m512& scale, __m512& base) {
  const __m512i both = _mm512_loadu_si512(pairs);  // lane i: scale_i in the low half, zero_i in the high one
  scale = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
  const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(both, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  base = _mm512_fmadd_ps(_mm512_set1_ps(-8.f), scale, zero);
}

inline void scale_base(const float* pairs, __m512& scale, __m512& base) {
  const __m512 a = _mm512_loadu_ps(pairs), b = _mm512_loadu_ps(pairs + 16);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  scale = _mm512_permutex2var_ps(a, even, b);
  base = _mm512_fmadd_ps(_mm512_set1_ps(-8.f), scale, _mm512_permutex2var_ps(a, odd, b));
}

inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline void store16(c10::BFloat16* dst, __m512 v) {
  const __m256bh r = _mm512_cvtneps_pbh(v);  // round to nearest even, as torch's conversion of a finite value
  std::memcpy(dst, &r, 32);
}
#endif

#if defined(__AVX512F__)
// Folds a group's code sums into the outputs: y += scale * acc + base * (the group's sum of x)
template <int ROWS, typename scalar_t>
inline void fold_group(const Problem& p, int64_t first, int64_t g, int64_t row0, __m512 (&acc)[2][ROWS],
                       __m512 (&y)[2][ROWS]) {
  const scalar_t* sz = static_cast<const scalar_t*>(p.sz) + (g * p.n + first) * 2;
  __m512 scale[2], base[2];
  scale_base(sz, scale[0], base[0]);             // outputs first .. first + 15
  scale_base(sz + 64, scale[1], base[1]);        // outputs first + 32 .. first + 47
  for (int r = 0; r < ROWS; ++r) {
    const __m512 sum = _mm512_set1_ps(p.sums[(row0 + r) * p.groups + g]);
    for (int s = 0; s < 2; ++s) {
      y[s][r] = _mm512_fmadd_ps(scale[s], acc[s][r], y[s][r]);
      y[s][r] = _mm512_fmadd_ps(base[s], sum, y[s][r]);
      acc[s][r] = _mm512_setzero_ps();
    }
  }
}

template <int ROWS, typename scalar_t>
inline void store_rows(const Problem& p, int64_t first, int64_t row0, __m512 (&y)[2][ROWS]) {
  scalar_t* out = static_cast<scalar_t*>(p.out);
  for (int r = 0; r < ROWS; ++r) {
    store16(out + (row0 + r) * p.n + first, y[0][r]);
    store16(out + (row0 + r) * p.n + first + 32, y[1][r]);
  }
}

// float32 activations: half block `h` of block `nb` for rows row0 .. row0 + ROWS - 1
template <int ROWS>
void half_block_f32(const Problem& p, int64_t nb, int64_t h, int64_t row0) {
  const uint8_t* codes = p.packed + nb * p.k * 32 + 16 * h;
  const float* x = static_cast<const float*>(p.x) + row0 * p.k;
  const int64_t first = nb * kBlockN + 16 * h;
  const __m512i nibble = _mm512_set1_epi32(15);
  __m512 acc[2][ROWS], y[2][ROWS];
  for (int s = 0; s < 2; ++s)
    for (int r = 0; r < ROWS; ++r) acc[s][r] = y[s][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) {
      if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (k + kPrefetchInputs) * 32), _MM_HINT_T0);
      const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32)));
      const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(both, nibble));
      const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4));
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xk = _mm512_set1_ps(x[r * p.k + k]);
        acc[0][r] = _mm512_fmadd_ps(low, xk, acc[0][r]);
        acc[1][r] = _mm512_fmadd_ps(high, xk, acc[1][r]);
      }
    }
    fold_group<ROWS, float>(p, first, g, row0, acc, y);
  }
  store_rows<ROWS, float>(p, first, row0, y);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
// bfloat16 activations: a whole block (64 outputs) per pass over K, two inputs at a time. One byte permute of the
// 64 bytes of inputs k and k + 1 gives lane i the bytes (k: i, k: 16 + i, k + 1: i, k + 1: 16 + i), so each 16-bit
// word (word 0 input k, word 1 input k + 1) holds the codes of outputs i (bits 0-3), 32 + i (4-7), 16 + i (8-11)
// and 48 + i (12-15). A shift and one ternary logic op put a code into the top four mantissa bits of the bfloat16
// 16.0: the word is then exactly 16 + code, and `vdpbf16ps` adds (16 + q[k]) x[k] + (16 + q[k+1]) x[k+1] into the
// lane (exact products, float32 sums). The fold takes the 16 back out: y += scale * acc + (base - 16 scale) * sum.
// Four shifts and four logic ops and one permute per 128 codes: no table look-ups, one shuffle.
constexpr int kCodeOffset = 16;
constexpr int kQuarterOutput[4] = {0, 32, 16, 48};  // first output of each code position in a word (bits 0, 4, 8, 12)

template <int Q>
inline __m512i code_words(__m512i words) {  // the Q-th code of each word as the bfloat16 of 16 + code
  const __m512i mask = _mm512_set1_epi16(0x0078), sixteen = _mm512_set1_epi16(0x4180);
  const __m512i at3 = Q == 0 ? _mm512_slli_epi16(words, 3) : _mm512_srli_epi16(words, 4 * Q - 3);
  return _mm512_ternarylogic_epi32(at3, mask, sixteen, 0xEA);  // (at3 & mask) | sixteen
}

template <int ROWS>
void block_bf16(const Problem& p, int64_t nb, int64_t row0) {
  const uint8_t* codes = p.packed + nb * p.k * 32;
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + row0 * p.k;
  const c10::BFloat16* sz = static_cast<const c10::BFloat16*>(p.sz);
  const int64_t first = nb * kBlockN;
  alignas(64) uint8_t index[64];
  for (int i = 0; i < 16; ++i)
    for (int b = 0; b < 4; ++b) index[4 * i + b] = static_cast<uint8_t>(16 * b + i);
  const __m512i spread = _mm512_load_si512(index);
  alignas(64) float y[ROWS][kBlockN] = {};
  __m512 acc[4][ROWS];
  for (int64_t g = 0; g < p.groups; ++g) {
    if (first + kBlockN < p.n)  // the next block's scale-and-zero pairs: one group apart is N pairs, no stream
      for (int64_t line = 0; line < kBlockN * 2 * 2; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(sz + (g * p.n + first + kBlockN) * 2) + line, _MM_HINT_T0);
    for (int q = 0; q < 4; ++q)
      for (int r = 0; r < ROWS; ++r) acc[q][r] = _mm512_setzero_ps();
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (k + kPrefetchInputs) * 32), _MM_HINT_T0);
      const __m512i words = _mm512_permutexvar_epi8(spread, _mm512_loadu_si512(codes + k * 32));
      const __m512i w[4] = {code_words<0>(words), code_words<1>(words), code_words<2>(words), code_words<3>(words)};
      for (int r = 0; r < ROWS; ++r) {
        int32_t xs;
        std::memcpy(&xs, x + r * p.k + k, 4);  // x[k] in the low half, x[k + 1] in the high one
        const __m512i xk = _mm512_set1_epi32(xs);
        for (int q = 0; q < 4; ++q) acc[q][r] = _mm512_dpbf16_ps(acc[q][r], (__m512bh)w[q], (__m512bh)xk);
      }
    }
    for (int q = 0; q < 4; ++q) {
      __m512 scale, base;
      scale_base(sz + (g * p.n + first + kQuarterOutput[q]) * 2, scale, base);
      base = _mm512_fmadd_ps(_mm512_set1_ps(-static_cast<float>(kCodeOffset)), scale, base);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 sum = _mm512_set1_ps(p.sums[(row0 + r) * p.groups + g]);
        float* yq = y[r] + kQuarterOutput[q];
        __m512 v = _mm512_fmadd_ps(scale, acc[q][r], _mm512_load_ps(yq));
        _mm512_store_ps(yq, _mm512_fmadd_ps(base, sum, v));
      }
    }
  }
  c10::BFloat16* out = static_cast<c10::BFloat16*>(p.out);
  for (int r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < kBlockN; j += 16) store16(out + (row0 + r) * p.n + first + j, _mm512_load_ps(y[r] + j));
}
#endif

// `halves` halves of block nb from half h, float32 activations (both: a task of a whole block, whose codes are
// read from memory once)
template <int ROWS>
void half_blocks_f32(const Problem& p, int64_t nb, int64_t h, int64_t halves, int64_t row0) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < halves; ++i) half_block_f32<ROWS>(p, nb, h + i, row0);
#else
  TORCH_CHECK(false, "int4_gemv: not built for this input type");
#endif
}

template <int ROWS>
void block_rows(const Problem& p, bool bf16, int64_t nb, int64_t h, int64_t halves, int64_t row0) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
  if (bf16) return block_bf16<ROWS>(p, nb, row0);
#endif
  TORCH_CHECK(!bf16, "int4_gemv: not built for this input type");
  half_blocks_f32<ROWS>(p, nb, h, halves, row0);
}

void rows_of_task(const Problem& p, bool bf16, int64_t nb, int64_t h, int64_t halves) {
  for (int64_t row0 = 0; row0 < p.rows; row0 += kRowsPerPass) {
    switch (std::min(kRowsPerPass, p.rows - row0)) {
      case 1: block_rows<1>(p, bf16, nb, h, halves, row0); break;
      case 2: block_rows<2>(p, bf16, nb, h, halves, row0); break;
      case 3: block_rows<3>(p, bf16, nb, h, halves, row0); break;
      default: block_rows<4>(p, bf16, nb, h, halves, row0); break;
    }
  }
}

template <typename scalar_t>
std::vector<float> group_sums(const at::Tensor& x, int64_t group) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / group;
  const scalar_t* data = x.data_ptr<scalar_t>();
  std::vector<float> sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) s += static_cast<float>(data[r * k + i]);
      sums[r * groups + g] = s;
    }
  return sums;
}

at::Tensor int4_gemv(const at::Tensor& x_in, const at::Tensor& packed_in, int64_t group,
                     const at::Tensor& sz_in) {
  const at::Tensor x = x_in.contiguous(), packed = packed_in.contiguous(), sz = sz_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && sz.dim() == 3, "int4_gemv: x [M, K], packed [N, K/2], sz [G, N, 2]");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 ? kBFloat16 : (x.scalar_type() == at::kFloat && kFloat32),
              "int4_gemv: not built for ", x.scalar_type(), " inputs");
  TORCH_CHECK(sz.scalar_type() == x.scalar_type(), "int4_gemv: scales in another dtype than x");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.size(1) * 2 == k, "int4_gemv: packed is not [N, K/2] uint8");
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "int4_gemv: 1 to ", kMaxRows, " rows, got ", rows);
  TORCH_CHECK(n % kBlockN == 0, "int4_gemv: N must be a multiple of 64, got ", n);
  TORCH_CHECK(group % 2 == 0 && group > 0 && k % group == 0, "int4_gemv: group ", group, " does not divide K ", k);
  TORCH_CHECK(sz.size(0) == k / group && sz.size(1) == n && sz.size(2) == 2, "int4_gemv: sz is not [K/group, N, 2]");
  at::Tensor out = at::empty({rows, n}, x.options());
  const std::vector<float> sums = bf16 ? group_sums<c10::BFloat16>(x, group) : group_sums<float>(x, group);
  const Problem p{rows, k, n, group, k / group, packed.data_ptr<uint8_t>(), x.data_ptr(), sz.data_ptr(),
                  sums.data(), out.data_ptr()};
  // a task: half a block where a block's codes fit in L1 (more tasks to share between threads), else a whole
  // block, whose second half re-reads each group's codes from L1; each output's arithmetic is the same either way
  // bfloat16: a task is always a whole block (one pass gives its 64 outputs)
  const int64_t per_task = bf16 || k * 32 > kBlockBytesInL1 ? 2 : 1;
  at::parallel_for(0, n / kBlockN * 2 / per_task, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rows_of_task(p, bf16, t * per_task / 2, t * per_task % 2, per_task);
  });
  return out;
}

// ---- int8, one scale per output row (the output table) -------------------------------------------------------
// y[n] = scale[n] * sum_k q[n, k] x[k]: the codes widened to float32 and fused multiply-adds over the row's
// 16-input chunks in one float32 vector per (activation row, weight row); the lanes of four such vectors are summed
// together (one transposing add tree gives the four sums in one vector), times the rows' scales.
constexpr int64_t kRowsPerTask = 64;  // output rows per task
// how far ahead the table's rows are prefetched, into L2: 37 KB at K = 576, more than L1 holds, so a prefetch into
// L1 this far ahead was evicted before its use; nearer ones came too late (about as slow as none)
constexpr int64_t kPrefetchRows = 64;

#if defined(__AVX512F__)
// The lane sums of a, b, c and d, in this order
inline __m128 sums_of_four(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a02 b02 a13 b13
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // per 128 bits: a b c d
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

// TOGETHER weight rows (independent accumulators) against ROWS activation rows: sums[r * TOGETHER + j]
template <int ROWS, int TOGETHER>
void int8_rows(const int8_t* q, const float* x, int64_t k, int64_t rows_n, float* sums) {
  __m512 acc[ROWS][TOGETHER];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < TOGETHER; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    if (c % 64 == 0)  // rows kPrefetchRows on: a stream read with arithmetic between its loads needs asking for
      for (int j = 0; j < TOGETHER; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(q + (kPrefetchRows + j) * k + c), _MM_HINT_T1);
    __m512 w[TOGETHER];
    for (int j = 0; j < TOGETHER; ++j)
      w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
          q + (j < rows_n ? j : 0) * k + c))));
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xc = _mm512_loadu_ps(x + r * k + c);
      for (int j = 0; j < TOGETHER; ++j) acc[r][j] = _mm512_fmadd_ps(w[j], xc, acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < TOGETHER; j += 4)
      _mm_storeu_ps(sums + r * TOGETHER + j, sums_of_four(acc[r][j], acc[r][j + 1], acc[r][j + 2], acc[r][j + 3]));
}
#endif

template <int TOGETHER, typename scalar_t>
void int8_task(const int8_t* q, const scalar_t* scales, const float* x, int64_t rows, int64_t k, int64_t n,
               int64_t begin, int64_t end, scalar_t* out) {
#if defined(__AVX512F__)
  float sums[kRowsPerPass * TOGETHER];
  for (int64_t j0 = begin; j0 < end; j0 += TOGETHER) {
    const int64_t together = std::min<int64_t>(TOGETHER, end - j0);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
      const int64_t pass = std::min(kRowsPerPass, rows - r0);
      const float* xr = x + r0 * k;
      switch (pass) {
        case 1: int8_rows<1, TOGETHER>(q + j0 * k, xr, k, together, sums); break;
        case 2: int8_rows<2, TOGETHER>(q + j0 * k, xr, k, together, sums); break;
        case 3: int8_rows<3, TOGETHER>(q + j0 * k, xr, k, together, sums); break;
        default: int8_rows<4, TOGETHER>(q + j0 * k, xr, k, together, sums); break;
      }
      for (int64_t r = 0; r < pass; ++r)
        for (int64_t j = 0; j < together; ++j)
          out[(r0 + r) * n + j0 + j] = static_cast<scalar_t>(sums[r * TOGETHER + j] *
                                                             static_cast<float>(scales[j0 + j]));
    }
  }
#else
  TORCH_CHECK(false, "int8_gemv: not built with AVX-512");
#endif
}

template <typename scalar_t>
void int8_range(const int8_t* q, const scalar_t* scales, const float* x, int64_t rows, int64_t k, int64_t n,
                int64_t begin, int64_t end, scalar_t* out) {
  // eight weight rows together where the activation rows leave registers for them: each output's arithmetic is
  // its own accumulator and its own lane sums either way
  if (rows <= 2)
    int8_task<8>(q, scales, x, rows, k, n, begin, end, out);
  else
    int8_task<4>(q, scales, x, rows, k, n, begin, end, out);
}

at::Tensor int8_gemv(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in) {
  const at::Tensor q = q_in.contiguous(), scales = scales_in.contiguous();
  TORCH_CHECK(kFloat32, "int8_gemv: not built with AVX-512");
  TORCH_CHECK(x_in.dim() == 2 && q.dim() == 2 && scales.dim() == 1, "int8_gemv: x [M, K], q [N, K], scales [N]");
  const int64_t rows = x_in.size(0), k = x_in.size(1), n = q.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "int8_gemv: 1 to ", kMaxRows, " rows, got ", rows);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) == k && k % 16 == 0, "int8_gemv: q is not [N, K] int8, K % 16");
  TORCH_CHECK(scales.scalar_type() == x_in.scalar_type() && scales.size(0) == n, "int8_gemv: scales [N] in x's dtype");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "int8_gemv: float32 or bfloat16 inputs");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, n}, x_in.options());
  const int8_t* qd = q.data_ptr<int8_t>();
  const float* xd = x.data_ptr<float>();
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * kRowsPerTask, last = std::min(n, end * kRowsPerTask);
    if (x_in.scalar_type() == at::kBFloat16)
      int8_range(qd, scales.data_ptr<c10::BFloat16>(), xd, rows, k, n, first, last, out.data_ptr<c10::BFloat16>());
    else
      int8_range(qd, scales.data_ptr<float>(), xd, rows, k, n, first, last, out.data_ptr<float>());
  });
  return out;
}

// ---- one decoding token's attention over a layer's used slots (bfloat16) ----------------------------------------
// q [B, H, 1, d] against keys and values [B, Hkv, L, d] (views of the store: any strides but the last), G = H / Hkv
// query heads per KV head: out[b, h] = sum_s softmax_s(scale * q . k_s) v_s, every sum in float32, rounded once
// to bfloat16. A task is (row, KV head, a chunk of kAttendSlots slots): its G heads' scores (`vdpbf16ps`: the
// products of bfloat16 values are exact, the sums float32; 16 slots' lane sums in one transposing add tree), their
// maximum, exp(score - maximum), their sum and the float32 sum of p * v; the chunks are then joined in slot order
// (flash-decoding's log-sum-exp join), so the split does not depend on the thread count and a row's bits do not
// depend on the other rows.
constexpr int64_t kAttendSlots = 64;  // slots per task: 2-thread batch-1 steps need several tasks per KV head
constexpr int64_t kAttendMaxG = 8;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
struct Attend {
  int64_t b, h, hkv, g, slots, d;
  const uint16_t *q, *k, *v;
  int64_t qs0, qs1, ks0, ks1, ks2, vs0, vs1, vs2;
  float scale;
};

// exp(x) in float32: x = n ln2 + r (two-constant Cody-Waite), Cephes' degree-6 polynomial for exp(r) (|r| <= ln2 / 2,
// within about one unit in the last place), times 2^n by scalef (0 below float32's range, as exp)
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The lane sums of v[0..15] as one vector (lane i: the sum of v[i]'s lanes)
inline __m512 sums_of_sixteen(__m512 (&v)[16]) {
  __m512 two[8], four[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: a02 b02 a13 b13
    two[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128 bits: the partial sums of rows 4i .. 4i + 3
    four[i] = _mm512_add_ps(_mm512_shuffle_ps(two[2 * i], two[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(two[2 * i], two[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(four[0], four[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(four[0], four[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(four[2], four[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(four[2], four[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 bfloat16 values widened to float32 (exact)
inline __m512 widen16(const uint16_t* src) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
}

// Task (row b, KV head hk, slots s0 .. s1 - 1): per query head g, its maximum m[g], sum of exps l[g] and
// acc[g][0 .. D) = sum_s exp(score_s - m[g]) v_s
template <int D, int G>
void attend_chunk(const Attend& a, int64_t b, int64_t hk, int64_t s0, int64_t s1, float* part) {
  constexpr int Q = D / 32, V = D / 16;
  __m512bh qv[G][Q];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < Q; ++j)
      qv[g][j] = (__m512bh)_mm512_loadu_si512(a.q + b * a.qs0 + (hk * G + g) * a.qs1 + 32 * j);
  alignas(64) float p[G][kAttendSlots];
  const int64_t n = s1 - s0;
  const uint16_t* keys = a.k + b * a.ks0 + hk * a.ks1;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    for (int g = 0; g < G; ++g) {
      __m512 lanes[16];
      for (int64_t i = 0; i < 16; ++i) {
        lanes[i] = _mm512_setzero_ps();
        if (i < m) {
          const uint16_t* kr = keys + (s0 + i0 + i) * a.ks2;
          for (int j = 0; j < Q; ++j)
            lanes[i] = _mm512_dpbf16_ps(lanes[i], (__m512bh)_mm512_loadu_si512(kr + 32 * j), qv[g][j]);
        }
      }
      _mm512_store_ps(p[g] + i0, _mm512_mul_ps(sums_of_sixteen(lanes), scale));
    }
  }
  float* out = part;  // [G][2 + D]: m, l, acc
  for (int g = 0; g < G; ++g, out += 2 + D) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p[g][i]);
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const __mmask16 live = n - i0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i0)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_load_ps(p[g] + i0), mv)));
      _mm512_store_ps(p[g] + i0, e);
      sum = _mm512_add_ps(sum, e);
    }
    out[0] = mx;
    out[1] = _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
  const uint16_t* values = a.v + b * a.vs0 + hk * a.vs1;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* vr = values + (s0 + i) * a.vs2;
    __m512 vv[V];
    for (int j = 0; j < V; ++j) vv[j] = widen16(vr + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 pi = _mm512_set1_ps(p[g][i]);
      for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(pi, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) _mm512_storeu_ps(part + g * (2 + D) + 2 + 16 * j, acc[g][j]);
}

template <int D>
void attend_chunk_g(const Attend& a, int64_t b, int64_t hk, int64_t s0, int64_t s1, float* part) {
  switch (a.g) {
    case 1: return attend_chunk<D, 1>(a, b, hk, s0, s1, part);
    case 2: return attend_chunk<D, 2>(a, b, hk, s0, s1, part);
    case 3: return attend_chunk<D, 3>(a, b, hk, s0, s1, part);
    case 4: return attend_chunk<D, 4>(a, b, hk, s0, s1, part);
    case 5: return attend_chunk<D, 5>(a, b, hk, s0, s1, part);
    case 6: return attend_chunk<D, 6>(a, b, hk, s0, s1, part);
    case 7: return attend_chunk<D, 7>(a, b, hk, s0, s1, part);
    default: return attend_chunk<D, 8>(a, b, hk, s0, s1, part);
  }
}
#endif

at::Tensor decode_attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attend: q [B, H, 1, d], keys and values [B, Hkv, L, d]");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(3), hkv = keys.size(1), slots = keys.size(2);
  TORCH_CHECK(keys.size(0) == b && keys.size(3) == d && hkv > 0 && h % hkv == 0 && h / hkv <= kAttendMaxG,
              "decode_attend: keys [B, Hkv, L, d] with H a multiple of Hkv, at most ", kAttendMaxG, " per KV head");
  TORCH_CHECK(d == 64 || d == 128, "decode_attend: head size 64 or 128, got ", d);
  TORCH_CHECK(slots >= 1, "decode_attend: no slot to attend to");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "decode_attend: bfloat16 q, keys and values");
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1, "decode_attend: d not contiguous");
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const Attend a{b, h, hkv, h / hkv, slots, d,
                 reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(keys.data_ptr()),
                 reinterpret_cast<const uint16_t*>(values.data_ptr()),
                 q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
                 values.stride(0), values.stride(1), values.stride(2), static_cast<float>(scale)};
  const int64_t chunks = (slots + kAttendSlots - 1) / kAttendSlots, width = a.g * (2 + d);
  std::vector<float> parts(b * hkv * chunks * width);
  at::parallel_for(0, b * hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t % chunks, bh = t / chunks, s0 = c * kAttendSlots;
      const int64_t s1 = std::min(slots, s0 + kAttendSlots);
      if (d == 64)
        attend_chunk_g<64>(a, bh / hkv, bh % hkv, s0, s1, parts.data() + t * width);
      else
        attend_chunk_g<128>(a, bh / hkv, bh % hkv, s0, s1, parts.data() + t * width);
    }
  });
  at::Tensor out = at::empty({b, h, 1, d}, q.options());
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  std::vector<float> y(d);
  for (int64_t bh = 0; bh < b * hkv; ++bh)
    for (int64_t g = 0; g < a.g; ++g) {  // the chunks joined in slot order
      float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, parts[(bh * chunks + c) * width + g * (2 + d)]);
      std::fill(y.begin(), y.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = parts.data() + (bh * chunks + c) * width + g * (2 + d);
        const float w = chunks == 1 ? 1.f : std::exp(part[0] - mx);
        total += w * part[1];
        for (int64_t j = 0; j < d; ++j) y[j] += w * part[2 + j];
      }
      const __m512 inv = _mm512_set1_ps(1.f / total);
      c10::BFloat16* dst = o + (bh / hkv) * h * d + ((bh % hkv) * a.g + g) * d;
      for (int64_t j = 0; j < d; j += 16) store16(dst + j, _mm512_mul_ps(_mm512_loadu_ps(y.data() + j), inv));
    }
  return out;
#else
  TORCH_CHECK(false, "decode_attend: not built with AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infinigen, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, int group, Tensor scale_zero) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("decode_attend(Tensor q, Tensor keys, Tensor values, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(infinigen, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("decode_attend", &decode_attend);
}
