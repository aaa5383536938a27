/* A step's attention kernels in vectors: the scores, softmax and weighted values of one part of
 * the keys (step.c's q4_attend cuts them into parts and joins them), for bf16 keys and values or
 * 8-bit ones (a row's d int8 then its float scale: common.h's KV8_ROW).
 */
#include "common.h"

/* Attention's loops in explicit vectors (W lanes: 8 for T256, 16 for T512), head sizes a
 * multiple of HEAD_STEP. Keys and values are read as bf16 and widened in registers; each score
 * is one query's dot product with one key: a product, then fused adds over the head's vectors
 * in order, its lanes then added in one fixed pattern (REDUCE4, four keys at a time, every key
 * alike); each weighted value a chain of fused adds over the keys in order. A query's bits thus
 * depend on its own q and the keys it sees, not on the queries it is grouped with nor on the
 * slots of the keys it does not see (their weights are an exact 0). */
#define ALWAYS static inline __attribute__((always_inline))
#define GROUP_MAX 6 /* the most queries whose scores and weighted values are made together (registers: */
/* 6 with AVX-512's 32 vector registers, 3 with AVX2's 16; the `GQ` of SCORES and VALUES) */
/* F(G, ...) for the group size g ≤ GQ, G a constant (the kernels are unrolled by it). */
#define BY_GROUP(GQ, g, F, ...)                                                                                      \
  do {                                                                                                               \
    if (GQ >= 6 && g == 6)                                                                                           \
      F(6, __VA_ARGS__);                                                                                             \
    else if (GQ >= 5 && g == 5)                                                                                      \
      F(5, __VA_ARGS__);                                                                                             \
    else if (GQ >= 4 && g == 4)                                                                                      \
      F(4, __VA_ARGS__);                                                                                             \
    else if (g == 3)                                                                                                 \
      F(3, __VA_ARGS__);                                                                                             \
    else if (g == 2)                                                                                                 \
      F(2, __VA_ARGS__);                                                                                             \
    else                                                                                                             \
      F(1, __VA_ARGS__);                                                                                             \
  } while (0)

/* Four 8-lane partial sums → their four sums, each ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7)). */
#define REDUCE4_256(r0, r1, r2, r3)                                                                                  \
  ({                                                                                                                 \
    __m256 x0 = _mm256_add_ps(_mm256_permute2f128_ps(r0, r1, 0x20), _mm256_permute2f128_ps(r0, r1, 0x31));         \
    __m256 x1 = _mm256_add_ps(_mm256_permute2f128_ps(r2, r3, 0x20), _mm256_permute2f128_ps(r2, r3, 0x31));         \
    __m256 y = _mm256_hadd_ps(x0, x1), z = _mm256_hadd_ps(y, y);                                                     \
    _mm_unpacklo_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));                                         \
  })
/* 16 lanes: lane i and lane i + 8 added first, then as above (the same sums in the same pairs, with
 * fewer shuffles: two keys a vector, then four). */
#define REDUCE4_512(r0, r1, r2, r3)                                                                                  \
  ({                                                                                                                 \
    __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, 0x44), _mm512_shuffle_f32x4(r0, r1, 0xEE));             \
    __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, 0x44), _mm512_shuffle_f32x4(r2, r3, 0xEE));             \
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, 0x88), _mm512_shuffle_f32x4(a01, a23, 0xDD));           \
    __m512 w = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));                                                         \
    w = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));                                                                \
    __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0); /* each key's lane 0 */     \
    _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, w));                                                        \
  })

/* The cache formats the kernels read (F): its element type, a row's length in them, W lanes of
 * a row as floats, four keys' scores (REDUCE4's) scaled, a key's softmax weight as it multiplies
 * the key's value row. BF: bf16 rows of d; I8: d int8 then the row's float scale (KV8_ROW). */
#define BF_T uint16_t
#define BF_ROW(d) (d)
#define BF_LOAD16(p) LOAD_BF512(p)
#define BF_LOAD8(p) LOAD_BF256(p)
#define BF_KEYS4(s, kj, d) (s)
#define BF_WEIGHT(p, row, d) (p)
#define BF_FOLD 0 /* whether WEIGHTED folds each key's scale into its weights before VALUES */
#define I8_T int8_t
#define I8_ROW(d) KV8_ROW(d)
#define I8_LOAD16(p) LOAD_I8512(p)
#define I8_LOAD8(p) LOAD_I8256(p)
#define I8_KEYS4(s, kj, d)                                                                                           \
  _mm_mul_ps(s, _mm_setr_ps(kv8_scale(kj[0], d), kv8_scale(kj[1], d), kv8_scale(kj[2], d), kv8_scale(kj[3], d)))
#define I8_WEIGHT(p, row, d) (p) /* its scale folded in (WEIGHTED) */
#define I8_FOLD 1

/* s[m·padded + j] = qf_m · key j for G queries (qf: G rows of d floats) and the keys [j0, j1)
 * (keys from `length` on read key length - 1: the caller masks them). The callers go over the
 * keys in spans of SPAN, every group of queries in turn on a span (its keys stay in cache); the
 * first group also prefetches 8-bit values to L2 (v; NULL: none), whose scales WEIGHTED reads next
 * (their first touch there stalled a one-token step's attention ~10 % at 4,000 keys). */
#define SPAN 256
#define AHEAD_KEYS 16 /* keys ahead whose keys and values a pass prefetches (past the end: a hint, never read) */
#define SCORES(NAME, TARGET, VEC, W, P, F, REDUCE4, GQ)                                                              \
  TARGET ALWAYS void NAME##_g(const int G, int64_t D, const float *qf, const F##_T *k, const F##_T *v,             \
                              int64_t length, int64_t padded, int64_t from, int64_t to, float *s) {                  \
    int64_t d = W * D;                                                                                               \
    for (int64_t j0 = from; j0 < to; j0 += 4) {                                                                      \
      const F##_T *kj[4];                                                                                            \
      for (int jj = 0; jj < 4; jj++) kj[jj] = k + (j0 + jj < length ? j0 + jj : length - 1) * F##_ROW(d);            \
      for (int64_t b = 0; b < 4 * F##_ROW(d) * (int64_t)sizeof(F##_T); b += 64)                                      \
        _mm_prefetch((const char *)(k + (j0 + AHEAD_KEYS) * F##_ROW(d)) + b, _MM_HINT_T0);                           \
      if (F##_FOLD && v) /* WEIGHTED reads their scales before VALUES (bf16: VALUES prefetches its own) */         \
        for (int64_t b = 0; b < 4 * F##_ROW(d) * (int64_t)sizeof(F##_T); b += 64)                                    \
          _mm_prefetch((const char *)(v + (j0 + AHEAD_KEYS) * F##_ROW(d)) + b, _MM_HINT_T1);                         \
      VEC r[GROUP_MAX][4], key[4];                                                                                   \
      for (int jj = 0; jj < 4; jj++) key[jj] = F##_LOAD##W(kj[jj]);                                                  \
      for (int m = 0; m < G; m++) {                                                                                  \
        VEC qm = P##_loadu_ps(qf + m * d);                                                                           \
        for (int jj = 0; jj < 4; jj++) r[m][jj] = P##_mul_ps(qm, key[jj]);                                           \
      }                                                                                                              \
      for (int64_t c = 1; c < D; c++) {                                                                              \
        for (int jj = 0; jj < 4; jj++) key[jj] = F##_LOAD##W(kj[jj] + W * c);                                       \
        for (int m = 0; m < G; m++) {                                                                                \
          VEC qm = P##_loadu_ps(qf + m * d + W * c);                                                                 \
          for (int jj = 0; jj < 4; jj++) r[m][jj] = P##_fmadd_ps(qm, key[jj], r[m][jj]);                             \
        }                                                                                                            \
      }                                                                                                              \
      for (int m = 0; m < G; m++)                                                                                    \
        _mm_storeu_ps(s + m * padded + j0, F##_KEYS4(REDUCE4(r[m][0], r[m][1], r[m][2], r[m][3]), kj, d));           \
    }                                                                                                                \
  }                                                                                                                  \
  TARGET static void NAME(int64_t n, int64_t d, const float *qf, const F##_T *k, const F##_T *v, int64_t length,   \
                          int64_t padded, float *s) {                                                                \
    for (int64_t from = 0; from < padded; from += SPAN) {                                                            \
      int64_t to = padded - from < SPAN ? padded : from + SPAN;                                                      \
      for (int64_t m = 0; m < n; m += GQ) {                                                                          \
        int64_t g = n - m < GQ ? n - m : GQ;                                                                         \
        BY_GROUP(GQ, g, NAME##_g, d / W, qf + m * d, k, m ? 0 : v, length, padded, from, to, s + m * padded);        \
      }                                                                                                              \
    }                                                                                                                \
  }

/* For G queries: acc_m (d floats) += Σ_j p_m[j] · value j over the keys [from, to) in order (the
 * weights' sums are WEIGHTED's: SUMS); C vectors of a row at a time (the row in blocks of C), VALUE_BLOCK
 * keys at a time (their values then read again from the cache for the next C vectors). */
#define VALUE_BLOCK 16
#define VALUES(NAME, TARGET, VEC, W, P, F, GQ)                                                                       \
  TARGET ALWAYS void NAME##_gc(const int G, const int C, int64_t d, int64_t c0, int64_t j0, int64_t stop,           \
                               const float *p, int64_t padded, const F##_T *v, float *acc) {                         \
    VEC a[GROUP_MAX][4];                                                                                             \
    for (int m = 0; m < G; m++)                                                                                      \
      for (int c = 0; c < C; c++) a[m][c] = P##_loadu_ps(acc + m * d + W * (c0 + c));                                \
    for (int64_t j = j0; j < stop; j++) {                                                                            \
      if (c0 == 0)                                                                                                   \
        for (int64_t l = 0; l < F##_ROW(d) * (int64_t)sizeof(F##_T); l += 64)                                        \
          _mm_prefetch((const char *)(v + (j + AHEAD_KEYS) * F##_ROW(d)) + l, _MM_HINT_T0);                          \
      VEC b[GROUP_MAX];                                                                                                \
      for (int m = 0; m < G; m++)                                                                                    \
        b[m] = P##_set1_ps(F##_WEIGHT(p[m * padded + j], v + j * F##_ROW(d), d));                                    \
      for (int c = 0; c < C; c++) {                                                                                  \
        VEC x = F##_LOAD##W(v + j * F##_ROW(d) + W * (c0 + c));                                                      \
        for (int m = 0; m < G; m++) a[m][c] = P##_fmadd_ps(b[m], x, a[m][c]);                                        \
      }                                                                                                              \
    }                                                                                                                \
    for (int m = 0; m < G; m++)                                                                                      \
      for (int c = 0; c < C; c++) P##_storeu_ps(acc + m * d + W * (c0 + c), a[m][c]);                               \
  }                                                                                                                  \
  TARGET ALWAYS void NAME##_g(const int G, int64_t d, int64_t from, int64_t to, const float *p, int64_t padded,     \
                              const F##_T *v, float *acc) {                                                          \
    int64_t D = d / W;                                                                                               \
    for (int64_t j0 = from; j0 < to; j0 += VALUE_BLOCK) {                                                            \
      int64_t stop = to - j0 < VALUE_BLOCK ? to : j0 + VALUE_BLOCK;                                                  \
      int64_t c0 = 0;                                                                                                \
      for (; c0 + 4 <= D; c0 += 4) NAME##_gc(G, 4, d, c0, j0, stop, p, padded, v, acc);                              \
      for (; c0 < D; c0++) NAME##_gc(G, 1, d, c0, j0, stop, p, padded, v, acc);                                      \
    }                                                                                                                \
  }                                                                                                                  \
  TARGET static void NAME(int64_t n, int64_t d, int64_t length, const float *p, int64_t padded, const F##_T *v,      \
                          float *acc) { /* in spans of SPAN keys, as the scores */                                   \
    for (int64_t i = 0; i < n * d; i++) acc[i] = 0.0f;                                                               \
    for (int64_t from = 0; from < length; from += SPAN) {                                                            \
      int64_t to = length - from < SPAN ? length : from + SPAN;                                                      \
      for (int64_t m = 0; m < n; m += GQ) {                                                                          \
        int64_t g = n - m < GQ ? n - m : GQ;                                                                         \
        BY_GROUP(GQ, g, NAME##_g, d, from, to, p + m * padded, padded, v, acc + m * d);                              \
      }                                                                                                              \
    }                                                                                                                \
  }

/* x ← e^x lane by lane for x <= 0 (common.h's EXP_VEC); count a multiple of the lanes. Also
 * decode.c's gated activations (common.h). */
#define EXPS(NAME, TARGET, VEC, W, P, EXP)                                                                            \
  TARGET void NAME(int64_t count, float *x) {                                                                        \
    for (int64_t j = 0; j < count; j += W) P##_storeu_ps(x + j, EXP(P##_loadu_ps(x + j)));                          \
  }

SCORES(scores512, T512, __m512, 16, _mm512, BF, REDUCE4_512, 6)
SCORES(scores256, T256, __m256, 8, _mm256, BF, REDUCE4_256, 3)
VALUES(values512, T512, __m512, 16, _mm512, BF, 6)
VALUES(values256, T256, __m256, 8, _mm256, BF, 3)
SCORES(scores512_8, T512, __m512, 16, _mm512, I8, REDUCE4_512, 6)
SCORES(scores256_8, T256, __m256, 8, _mm256, I8, REDUCE4_256, 3)
VALUES(values512_8, T512, __m512, 16, _mm512, I8, 6)
VALUES(values256_8, T256, __m256, 8, _mm256, I8, 3)
EXPS(exps512, T512, __m512, 16, _mm512, exp512)
EXPS(exps256, T256, __m256, 8, _mm256, exp256)

/* Attention of up to QUERIES queries that share a kv head (their q scaled, as floats: qf),
 * against the keys and values [from, to) of one part: each query's top score there (-inf where it
 * sees none of them), the sum of its softmax weights e^(score - top) (0 for a key it does not
 * see) and its weighted sum of values, unnormalized. Keys before `open` are seen by every query,
 * from there on mask[m][j] says (0: seen). The work is proportional to the queries (a one-token
 * step's 3 queries do not pay for 16 lanes). work: PART_WORK(n, to - from) floats. */
/* A part's softmax and weighted values once its scores (n rows of `padded`, the part's keys [from,
 * to)) are made: each query's top, weights (an exact 0 for a key it does not see) and their sum,
 * then (acc not NULL) its weighted values. Also attend_amx.c's, after its scores. */
#define WEIGHTED(NAME, VALUES, EXPS, SUMS, TOP, TARGET, F)                                                           \
  TARGET void NAME(int64_t n, int64_t d, const F##_T *v, int64_t from,    int64_t to, int64_t open,                  \
                   const uint16_t *const *mask, float *scores, float *top, float *total, float *acc) {              \
    int64_t length = to - from, padded = PADDED(length), seen = open > from ? open : from;                           \
    for (int64_t m = 0; m < n; m++) { /* softmax weights, unnormalized */                                            \
      float *sm = scores + m * padded, t = -INFINITY;                                                                \
      if (mask[m])                                                                                                   \
        for (int64_t j = seen; j < to; j++)                                                                          \
          if ((mask[m][j] & 0x7fff) != 0) sm[j - from] = -INFINITY;                                                  \
      for (int64_t j = length; j < padded; j++) sm[j] = -INFINITY;                                                   \
      top[m] = t = TOP(padded, sm);                                                                                  \
      if (t == -INFINITY) { /* it sees no key of this part */                                                        \
        for (int64_t j = 0; j < padded; j++) sm[j] = 0.0f;                                                           \
        continue;                                                                                                    \
      }                                                                                                              \
      _Pragma("omp simd") for (int64_t j = 0; j < padded; j++) sm[j] -= t;                                           \
      EXPS(padded, sm);                                                                                              \
      if (mask[m])                                                                                                   \
        for (int64_t j = seen; j < to; j++)                                                                          \
          if ((mask[m][j] & 0x7fff) != 0) sm[j - from] = 0.0f;                                                       \
      for (int64_t j = length; j < padded; j++) sm[j] = 0.0f;                                                        \
    }                                                                                                                \
    for (int64_t m = 0; m < n; m++) total[m] = SUMS(padded, scores + m * padded); /* the weights' sums */           \
    if (acc && !F##_FOLD) {                                                                                          \
      VALUES(n, d, length, scores, padded, v + from * F##_ROW(d), acc);                                              \
      return;                                                                                                        \
    }                                                                                                                \
    if (acc) { /* F##_FOLD: each weight times its key's scale (F##_WEIGHT's product), then the values */             \
      float units[PADDED(SPLIT)]; /* a part has at most SPLIT keys */                                                \
      for (int64_t j = 0; j < length; j++) units[j] = kv8_scale((const int8_t *)(v + (from + j) * F##_ROW(d)), d);   \
      for (int64_t m = 0; m < n; m++) {                                                                              \
        _Pragma("omp simd") for (int64_t j = 0; j < length; j++) scores[m * padded + j] *= units[j];                 \
      }                                                                                                              \
      VALUES(n, d, length, scores, padded, v + from * F##_ROW(d), acc);                                              \
    }                                                                                                                \
  }
WEIGHTED(weighted512, values512, exps512, sums512, top512, T512, BF)
WEIGHTED(weighted256, values256, exps256, sums256, top256, T256, BF)
WEIGHTED(weighted512_8, values512_8, exps512, sums512, top512, T512, I8)
WEIGHTED(weighted256_8, values256_8, exps256, sums256, top256, T256, I8)

/* One part's attention: its scores in vectors, then WEIGHTED. */
#define ATTEND(NAME, SCORES, WEIGHTED, TARGET, F)                                                                    \
  TARGET void NAME(ATTEND_ARGS) {                                                                                    \
    const F##_T *k = keys, *v = values;                                                                              \
    SCORES(n, d, qf, k + from * F##_ROW(d), v + from * F##_ROW(d), to - from, PADDED(to - from), work);              \
    WEIGHTED(n, d, v, from, to, open, mask, work, top, total, acc);                                                  \
  }
ATTEND(attend512, scores512, weighted512, T512, BF)
ATTEND(attend256, scores256, weighted256, T256, BF)
ATTEND(attend512_8, scores512_8, weighted512_8, T512, I8)
ATTEND(attend256_8, scores256_8, weighted256_8, T256, I8)
