/* Rows of bf16 logits: each row's k largest (values and indices) and its log-sum-exp, what a
 * drafter reads of a vocabulary-wide row (the candidates and their probabilities). torch does it
 * with a float32 copy of the row and a (value, index) pair per entry for its top-k: on a 262k
 * vocabulary ~5 MB of working memory a row and 2-3 ms for four heads' rows on 2 cores. Here: one
 * pass that keeps the k best (a lane's value is looked at only where it beats the k-th best so
 * far), one pass of exponentials, no memory beyond the outputs. */
#include "common.h"

/* Insert (v, i) into the sorted (largest first) `*count` best of at most k: after the values it does
 * not exceed, so of equal values the lower index (seen first) stays first, as torch's topk keeps
 * them on the CPU. */
static void keep(float *vals, int64_t *idx, int64_t k, int64_t *count, float v, int64_t i) {
  int64_t at = *count < k ? (*count)++ : k - 1;
  while (at > 0 && vals[at - 1] < v) {
    vals[at] = vals[at - 1], idx[at] = idx[at - 1];
    at--;
  }
  vals[at] = v, idx[at] = i;
}

/* The k best of a row (k <= n): a chunk's lanes above the k-th best so far go in one at a time,
 * the bar rising as they do. Nonzero where the row holds a NaN (the caller then falls back to torch). */
#define BEST(NAME, TARGET, VEC, P, W, LOAD, CMP_MASK, MASK_T)                                                      \
  TARGET static int NAME(const uint16_t *x, int64_t n, int64_t k, float *vals, int64_t *idx) {                     \
    int64_t count = 0, i = 0;                                                                                      \
    int nan = 0;                                                                                                   \
    for (; i + W <= n; i += W) {                                                                                   \
      VEC v = LOAD(x + i);                                                                                         \
      nan |= CMP_MASK(v, v, _CMP_UNORD_Q) != 0;                                                                    \
      MASK_T up = count < k ? CMP_MASK(v, v, _CMP_ORD_Q) : CMP_MASK(v, P##_set1_ps(vals[k - 1]), _CMP_GT_OQ);      \
      while (up) {                                                                                                 \
        int lane = __builtin_ctz(up);                                                                              \
        up &= up - 1;                                                                                              \
        float value = bf16_to_float(x[i + lane]);                                                                  \
        if (count < k || value > vals[k - 1]) keep(vals, idx, k, &count, value, i + lane);                         \
      }                                                                                                            \
    }                                                                                                              \
    for (; i < n; i++) {                                                                                           \
      float value = bf16_to_float(x[i]);                                                                           \
      nan |= value != value;                                                                                       \
      if (count < k || value > vals[k - 1]) keep(vals, idx, k, &count, value, i);                                  \
    }                                                                                                              \
    return nan || count < k;                                                                                       \
  }
#define CMP512(a, b, c) _mm512_cmp_ps_mask(a, b, c)
#define CMP256(a, b, c) ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, c)))
BEST(best512, T512, __m512, _mm512, 16, LOAD_BF512, CMP512, __mmask16)
BEST(best256, T256, __m256, _mm256, 8, LOAD_BF256, CMP256, unsigned)

/* Σ e^(x − top) over a row (top its largest), four vectors side by side. */
#define SUM_EXP(NAME, TARGET, VEC, P, W, LOAD, EXP, REDUCE)                                                       \
  TARGET static float NAME(const uint16_t *x, int64_t n, float top) {                                              \
    VEC s0 = P##_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, t = P##_set1_ps(top);                                    \
    int64_t i = 0;                                                                                                 \
    for (; i + 4 * W <= n; i += 4 * W) {                                                                           \
      s0 = P##_add_ps(s0, EXP(P##_sub_ps(LOAD(x + i), t)));                                                        \
      s1 = P##_add_ps(s1, EXP(P##_sub_ps(LOAD(x + i + W), t)));                                                    \
      s2 = P##_add_ps(s2, EXP(P##_sub_ps(LOAD(x + i + 2 * W), t)));                                                \
      s3 = P##_add_ps(s3, EXP(P##_sub_ps(LOAD(x + i + 3 * W), t)));                                                \
    }                                                                                                              \
    float sum = REDUCE(P##_add_ps(P##_add_ps(s0, s1), P##_add_ps(s2, s3)));                                        \
    for (; i < n; i++) sum += expf(bf16_to_float(x[i]) - top);                                                     \
    return sum;                                                                                                    \
  }
T256 static float reduce256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
SUM_EXP(sum_exp512, T512, __m512, _mm512, 16, LOAD_BF512, exp512, _mm512_reduce_add_ps)
SUM_EXP(sum_exp256, T256, __m256, _mm256, 8, LOAD_BF256, exp256, reduce256)

/* Each of `rows` rows of n bf16 logits (ld apart): its k largest values (float, largest first) and
 * their indices (of equal values the lower index first), k <= n, and its log-sum-exp. The rows
 * over the threads. Returns how many rows hold a NaN or +inf (their outputs then say nothing). */
int q4_top(int isa, int threads, int64_t rows, int64_t n, const uint16_t *x, int64_t ld, int64_t k, float *vals,
           int64_t *idx, float *lse) {
  int wide = (isa & ISA_VARIANT) == 2, nans = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : nans) if (rows > 1 && rows * n >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *xr = x + r * ld;
    float *vr = vals + r * k;
    nans += (wide ? best512 : best256)(xr, n, k, vr, idx + r * k);
    float top = vr[0];
    if (top == INFINITY) nans++; /* e^(x − top) says nothing there */
    lse[r] = top == -INFINITY ? -INFINITY : top + logf((wide ? sum_exp512 : sum_exp256)(xr, n, top));
  }
  return nans;
}
