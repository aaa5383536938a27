/* A decoding step's attention and RMSNorm in bf16, and whole decoder layers.
 *
 * Every row is computed on its own, in the same order whatever else the step holds: a tree's
 * node gets the bits a one-token step over the same keys would. Written as plain loops that
 * the compiler vectorizes for each target (T512, T256).
 */
#include "common.h"

static inline float bf(uint16_t b) { return bf16_to_float(b); }

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

/* s[m·padded + j] = qf_m · key j for G queries (qf: G rows of d floats) and the keys [j0, j1)
 * (keys from `length` on read key length - 1: the caller masks them). The callers go over the
 * keys in spans of SPAN, every group of queries in turn on a span (its keys stay in cache). */
#define SPAN 256
#define AHEAD_KEYS 16 /* keys ahead whose keys and values a pass prefetches (past the end: a hint, never read) */
#define SCORES(NAME, TARGET, VEC, W, P, LOAD_BF, REDUCE4, GQ)                                                        \
  TARGET ALWAYS void NAME##_g(const int G, int64_t D, const float *qf, const uint16_t *k, int64_t length,           \
                              int64_t padded, int64_t from, int64_t to, float *s) {                                  \
    int64_t d = W * D;                                                                                               \
    for (int64_t j0 = from; j0 < to; j0 += 4) {                                                                      \
      const uint16_t *kj[4];                                                                                         \
      for (int jj = 0; jj < 4; jj++) kj[jj] = k + (j0 + jj < length ? j0 + jj : length - 1) * d;                     \
      for (int64_t b = 0; b < 4 * d * 2; b += 64)                                                                    \
        _mm_prefetch((const char *)(k + (j0 + AHEAD_KEYS) * d) + b, _MM_HINT_T0);                                      \
      VEC r[GROUP_MAX][4], key[4];                                                                                   \
      for (int jj = 0; jj < 4; jj++) key[jj] = LOAD_BF(kj[jj]);                                                      \
      for (int m = 0; m < G; m++) {                                                                                  \
        VEC qm = P##_loadu_ps(qf + m * d);                                                                           \
        for (int jj = 0; jj < 4; jj++) r[m][jj] = P##_mul_ps(qm, key[jj]);                                           \
      }                                                                                                              \
      for (int64_t c = 1; c < D; c++) {                                                                              \
        for (int jj = 0; jj < 4; jj++) key[jj] = LOAD_BF(kj[jj] + W * c);                                            \
        for (int m = 0; m < G; m++) {                                                                                \
          VEC qm = P##_loadu_ps(qf + m * d + W * c);                                                                 \
          for (int jj = 0; jj < 4; jj++) r[m][jj] = P##_fmadd_ps(qm, key[jj], r[m][jj]);                             \
        }                                                                                                            \
      }                                                                                                              \
      for (int m = 0; m < G; m++) _mm_storeu_ps(s + m * padded + j0, REDUCE4(r[m][0], r[m][1], r[m][2], r[m][3]));    \
    }                                                                                                                \
  }                                                                                                                  \
  TARGET static void NAME(int64_t n, int64_t d, const float *qf, const uint16_t *k, int64_t length, int64_t padded,  \
                          float *s) {                                                                                \
    for (int64_t from = 0; from < padded; from += SPAN) {                                                            \
      int64_t to = padded - from < SPAN ? padded : from + SPAN;                                                      \
      for (int64_t m = 0; m < n; m += GQ) {                                                                          \
        int64_t g = n - m < GQ ? n - m : GQ;                                                                         \
        BY_GROUP(GQ, g, NAME##_g, d / W, qf + m * d, k, length, padded, from, to, s + m * padded);                   \
      }                                                                                                              \
    }                                                                                                                \
  }

/* For G queries: acc_m (d floats) += Σ_j p_m[j] · value j and total_m += Σ_j p_m[j], over the
 * keys [from, to) in order; C vectors of a row at a time (the row in blocks of C), VALUE_BLOCK
 * keys at a time (their values then read again from the cache for the next C vectors). */
#define VALUE_BLOCK 16
#define VALUES(NAME, TARGET, VEC, W, P, LOAD_BF, GQ)                                                                 \
  TARGET ALWAYS void NAME##_gc(const int G, const int C, int64_t d, int64_t c0, int64_t j0, int64_t stop,           \
                               const float *p, int64_t padded, const uint16_t *v, float *acc) {                      \
    VEC a[GROUP_MAX][4];                                                                                             \
    for (int m = 0; m < G; m++)                                                                                      \
      for (int c = 0; c < C; c++) a[m][c] = P##_loadu_ps(acc + m * d + W * (c0 + c));                                \
    for (int64_t j = j0; j < stop; j++) {                                                                            \
      if (c0 == 0)                                                                                                   \
        for (int64_t l = 0; l < d * 2; l += 64)                                                                      \
          _mm_prefetch((const char *)(v + (j + AHEAD_KEYS) * d) + l, _MM_HINT_T0);                                   \
      VEC b[GROUP_MAX];                                                                                                \
      for (int m = 0; m < G; m++) b[m] = P##_set1_ps(p[m * padded + j]);                                             \
      for (int c = 0; c < C; c++) {                                                                                  \
        VEC x = LOAD_BF(v + j * d + W * (c0 + c));                                                                   \
        for (int m = 0; m < G; m++) a[m][c] = P##_fmadd_ps(b[m], x, a[m][c]);                                        \
      }                                                                                                              \
    }                                                                                                                \
    for (int m = 0; m < G; m++)                                                                                      \
      for (int c = 0; c < C; c++) P##_storeu_ps(acc + m * d + W * (c0 + c), a[m][c]);                               \
  }                                                                                                                  \
  TARGET ALWAYS void NAME##_g(const int G, int64_t d, int64_t from, int64_t to, const float *p, int64_t padded,     \
                              const uint16_t *v, float *acc, float *total) {                                         \
    int64_t D = d / W;                                                                                               \
    float t[GROUP_MAX] = {0.0f};                                                                           \
    for (int m = 0; m < G; m++) t[m] = total[m];                                                                     \
    for (int64_t j = from; j < to; j++) /* the queries' sums side by side: independent chains */                   \
      for (int m = 0; m < G; m++) t[m] += p[m * padded + j];                                                         \
    for (int m = 0; m < G; m++) total[m] = t[m];                                                                     \
    for (int64_t j0 = from; j0 < to; j0 += VALUE_BLOCK) {                                                            \
      int64_t stop = to - j0 < VALUE_BLOCK ? to : j0 + VALUE_BLOCK;                                                  \
      int64_t c0 = 0;                                                                                                \
      for (; c0 + 4 <= D; c0 += 4) NAME##_gc(G, 4, d, c0, j0, stop, p, padded, v, acc);                              \
      for (; c0 < D; c0++) NAME##_gc(G, 1, d, c0, j0, stop, p, padded, v, acc);                                      \
    }                                                                                                                \
  }                                                                                                                  \
  TARGET static void NAME(int64_t n, int64_t d, int64_t length, const float *p, int64_t padded, const uint16_t *v,   \
                          float *acc, float *total) { /* in spans of SPAN keys, as the scores */                    \
    for (int64_t m = 0; m < n; m++) {                                                                                \
      total[m] = 0.0f;                                                                                               \
      for (int64_t i = 0; i < d; i++) acc[m * d + i] = 0.0f;                                                         \
    }                                                                                                                \
    for (int64_t from = 0; from < length; from += SPAN) {                                                            \
      int64_t to = length - from < SPAN ? length : from + SPAN;                                                      \
      for (int64_t m = 0; m < n; m += GQ) {                                                                          \
        int64_t g = n - m < GQ ? n - m : GQ;                                                                         \
        BY_GROUP(GQ, g, NAME##_g, d, from, to, p + m * padded, padded, v, acc + m * d, total + m);                   \
      }                                                                                                              \
    }                                                                                                                \
  }

/* x ← e^x lane by lane for x <= 0 (common.h's EXP_VEC); count a multiple of the lanes. Also
 * decode.c's gated activations (common.h). */
#define EXPS(NAME, TARGET, VEC, W, P, EXP)                                                                            \
  TARGET void NAME(int64_t count, float *x) {                                                                        \
    for (int64_t j = 0; j < count; j += W) P##_storeu_ps(x + j, EXP(P##_loadu_ps(x + j)));                          \
  }

SCORES(scores512, T512, __m512, 16, _mm512, LOAD_BF512, REDUCE4_512, 6)
SCORES(scores256, T256, __m256, 8, _mm256, LOAD_BF256, REDUCE4_256, 3)
VALUES(values512, T512, __m512, 16, _mm512, LOAD_BF512, 6)
VALUES(values256, T256, __m256, 8, _mm256, LOAD_BF256, 3)
EXPS(exps512, T512, __m512, 16, _mm512, exp512)
EXPS(exps256, T256, __m256, 8, _mm256, exp256)

/* Attention of up to QUERIES queries that share a kv head (their q scaled, as floats: qf),
 * against the keys and values [from, to) of one part: each query's top score there (-inf where it
 * sees none of them), the sum of its softmax weights e^(score - top) (0 for a key it does not
 * see) and its weighted sum of values, unnormalized. Keys before `open` are seen by every query,
 * from there on mask[m][j] says (0: seen). The work is proportional to the queries (a one-token
 * step's 3 queries do not pay for 16 lanes). work: PART_WORK(n, to - from) floats. */
#define QUERIES 48 /* the most queries one pass over a kv head's keys and values serves */
#define HEAD_STEP 16 /* head sizes must be multiples of this (core/backends/stepops.py HEAD_STEP) */
#define KEYS 16
#define PADDED(length) (((length) + KEYS - 1) / KEYS * KEYS)
#define PART_WORK(n, length) ((n) * PADDED(length))
/* A part's softmax and weighted values once its scores (n rows of `padded`, the part's keys [from,
 * to)) are made: each query's top, weights (an exact 0 for a key it does not see) and their sum,
 * then (acc not NULL) its weighted values. Also attend_amx.c's, after its scores. */
#define WEIGHTED(NAME, VALUES, EXPS, TARGET)                                                                         \
  TARGET void NAME(int64_t n, int64_t d, const uint16_t *v, int64_t from, int64_t to, int64_t open,                  \
                   const uint16_t *const *mask, float *scores, float *top, float *total, float *acc) {              \
    int64_t length = to - from, padded = PADDED(length), seen = open > from ? open : from;                           \
    for (int64_t m = 0; m < n; m++) { /* softmax weights, unnormalized */                                            \
      float *sm = scores + m * padded, t = -INFINITY;                                                                \
      if (mask[m])                                                                                                   \
        for (int64_t j = seen; j < to; j++)                                                                          \
          if ((mask[m][j] & 0x7fff) != 0) sm[j - from] = -INFINITY;                                                  \
      for (int64_t j = length; j < padded; j++) sm[j] = -INFINITY;                                                   \
      _Pragma("omp simd reduction(max : t)") for (int64_t j = 0; j < padded; j++) t = sm[j] > t ? sm[j] : t;         \
      top[m] = t;                                                                                                    \
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
    if (acc) {                                                                                                       \
      VALUES(n, d, length, scores, padded, v + from * d, acc, total);                                                \
      return;                                                                                                        \
    }                                                                                                                \
    for (int64_t m = 0; m < n; m += 4) { /* the weights' sums alone, as VALUES makes them: 4 chains side by side */ \
      const float *s0 = scores + m * padded, *s1 = m + 1 < n ? s0 + padded : s0;                                     \
      const float *s2 = m + 2 < n ? s0 + 2 * padded : s0, *s3 = m + 3 < n ? s0 + 3 * padded : s0;                    \
      float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;                                                              \
      for (int64_t j = 0; j < length; j++) t0 += s0[j], t1 += s1[j], t2 += s2[j], t3 += s3[j];                       \
      float t[4] = {t0, t1, t2, t3};                                                                                 \
      for (int64_t i = 0; i < 4 && m + i < n; i++) total[m + i] = t[i];                                              \
    }                                                                                                                \
  }
WEIGHTED(weighted512, values512, exps512, T512)
WEIGHTED(weighted256, values256, exps256, T256)

/* One part's attention: its scores in vectors, then WEIGHTED. */
#define ATTEND(NAME, SCORES, WEIGHTED, TARGET)                                                                       \
  TARGET static void NAME(int64_t n, int64_t d, const float *qf, const uint16_t *k, const uint16_t *v, int64_t from, \
                          int64_t to, int64_t open, const uint16_t *const *mask, float *work, float *top,            \
                          float *total, float *acc) {                                                                \
    SCORES(n, d, qf, k + from * d, to - from, PADDED(to - from), work);                                              \
    WEIGHTED(n, d, v, from, to, open, mask, work, top, total, acc);                                                  \
  }
ATTEND(attend512, scores512, weighted512, T512)
ATTEND(attend256, scores256, weighted256, T256)

/* Long key ranges are cut into parts at fixed key positions (multiples of SPLIT counted from
 * position 0, whatever the first key's position), each part's attention made on its own and
 * the parts then joined in order: top = the parts' top, each part weighted by e^(its top - top).
 * A query's bits depend on its own q and the keys it sees, so a tree's node still gets those of
 * a one-token step at its position; one row's parts go to different threads, each reading its
 * keys and values once (one thread a kv head read them 1.33-2 times over, at a third of the
 * memory's speed). */
#define SPLIT 512

/* The queries of one task: query l is (row r, head g·group + h) for the task's kv head g. */
typedef struct {
  int64_t n;
  const uint16_t *q[QUERIES], *mask[QUERIES];
  uint16_t *out[QUERIES];
} block;

static void block_of(int64_t g, int64_t b, int64_t size, int64_t queries, int64_t group, int64_t heads, int64_t d,
                     const uint16_t *q, int64_t ldq, const uint16_t *mask, int64_t ldm, uint16_t *out, block *k) {
  k->n = queries - b * size < size ? queries - b * size : size;
  for (int64_t l = 0; l < k->n; l++) {
    int64_t r = (b * size + l) / group, h = g * group + (b * size + l) % group;
    k->q[l] = q + r * ldq + h * d;
    k->mask[l] = mask ? mask + r * ldm : 0;
    k->out[l] = out + (r * heads + h) * d;
  }
}

/* One part's result for a block of `size` queries: their tops, totals, then weighted values. */
#define RESULT(size, d) ((size) * (2 + (d)))

/* A block's parts (their results `stride` floats apart) joined in order → its outputs, bf16.
 * With one part every weight is 1 and each sum one term: the part's own result, exactly. */
static void join(const block *k, int64_t size, int64_t d, int64_t parts, int64_t stride, const float *results,
                 float *acc) {
  for (int64_t l = 0; l < k->n; l++) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t p = 0; p < parts; p++) top = results[p * stride + l] > top ? results[p * stride + l] : top;
    for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
    for (int64_t p = 0; p < parts; p++) {
      const float *r = results + p * stride;
      if (r[l] == -INFINITY) continue; /* it sees no key of this part */
      float w = r[l] == top ? 1.0f : expf(r[l] - top);
      total += r[size + l] * w;
      const float *values = r + 2 * size + l * d;
      for (int64_t i = 0; i < d; i++) acc[i] += values[i] * w;
    }
    float inv = 1.0f / total;
    for (int64_t i = 0; i < d; i++) k->out[l][i] = float_to_bf16(acc[i] * inv);
  }
}

/* out (t × heads × d) for queries q (t × heads × d, row stride ldq) against keys and values
 * (kv_heads × capacity × d, the first `length` used; key 0 at position `first`); query head h
 * reads kv head h / (heads / kv_heads). mask: t rows of ldm bf16 (the first `length` used), 0
 * where a query sees a key (NULL: every key is seen); keys before `open` are seen by every query
 * (q4_attention finds it); amx: 1 the scores on AMX, 2 the weighted values too (attend_amx.c; d a
 * multiple of 32, the AVX-512 variant; q4_attention and q4_decode take it from ISA_AMX_SCORES and
 * ISA_AMX_VALUES in the variant's number, where d allows and, for the values, the layer has no
 * sliding window). Returns 0, or -1 when scratch memory could not be had. */
int q4_attend(int isa, int amx, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
              int64_t first, const uint16_t *q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t capacity,
              const uint16_t *mask, int64_t ldm, int64_t open, float scale, uint16_t *out) {
  int64_t parts = (first + length + SPLIT - 1) / SPLIT - first / SPLIT; /* cut at the multiples of SPLIT */
  /* Each block of queries reads its kv head's keys and values once, so blocks are as large as
   * QUERIES allows; with one part, as many as give every thread the same number of them (a
   * one-token step's 3 queries a kv head split 2 + 1 on two threads: the second block finds the
   * keys in cache). */
  int64_t most = amx ? AMX_QUERIES : QUERIES, group = heads / kv_heads, queries = t * group;
  int64_t per = (queries + most - 1) / most;
  while (!amx && parts == 1 && (kv_heads * per) % threads && per < queries) per++; /* AMX: a tile's work whatever n */
  int64_t size = (queries + per - 1) / per, blocks = (queries + size - 1) / size;
  int64_t stride = RESULT(size, d), span = parts == 1 ? length : SPLIT; /* a part's results; its most keys */
  float *results = malloc(sizeof(float) * (size_t)(kv_heads * blocks * parts * stride));
  if (!results) return -1;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (t * heads * length >= 1024)
  {
    size_t floats = (size_t)(PART_WORK(size, span) + (amx ? AMX_WORK(PADDED(span), d) : size * d));
    float *work = malloc(sizeof(float) * floats);
    if (!work) {
#pragma omp atomic write
      failed = 1;
    }
    if (amx) q4_amx_begin();
#pragma omp for schedule(dynamic) collapse(3)
    for (int64_t g = 0; g < kv_heads; g++)
      for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < parts; p++) {
          if (!work) continue;
          block kb;
          block_of(g, b, size, queries, group, heads, d, q, ldq, mask, ldm, out, &kb);
          float *qf = work + PART_WORK(size, span), *res = results + ((g * blocks + b) * parts + p) * stride;
          int64_t from = p == 0 ? 0 : (first / SPLIT + p) * SPLIT - first;
          int64_t to = p == parts - 1 ? length : (first / SPLIT + p + 1) * SPLIT - first;
          const uint16_t *kg = k + g * capacity * d, *vg = v + g * capacity * d;
          if (amx) {
            q4_part_amx(amx, kb.n, d, kb.q, scale, kg, vg, from, to, open, kb.mask, work, qf, res, res + size,
                        res + 2 * size);
            continue;
          }
          for (int64_t m = 0; m < kb.n; m++) {
            _Pragma("omp simd") for (int64_t i = 0; i < d; i++) qf[m * d + i] = bf(kb.q[m][i]) * scale;
          }
          (isa == 2 ? attend512 : attend256)(kb.n, d, qf, kg, vg, from, to, open, kb.mask, work, res, res + size,
                                             res + 2 * size);
        }
    if (amx) q4_amx_end();
#pragma omp for schedule(static) collapse(2)
    for (int64_t g = 0; g < kv_heads; g++)
      for (int64_t b = 0; b < blocks; b++) {
        if (!work) continue;
        block kb;
        block_of(g, b, size, queries, group, heads, d, q, ldq, mask, ldm, out, &kb);
        join(&kb, size, d, parts, stride, results + (g * blocks + b) * parts * stride, work);
      }
    free(work);
  }
  free(results);
  return failed ? -1 : 0;
}

/* The first key some query does not see (length when every query sees every key). */
int64_t q4_first_hidden(const uint16_t *mask, int64_t t, int64_t length, int64_t ldm) {
  if (!mask) return length;
  for (int64_t j = 0; j < length; j++)
    for (int64_t r = 0; r < t; r++)
      if ((mask[r * ldm + j] & 0x7fff) != 0) return j;
  return length;
}

int q4_attention(int isa, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
                 const uint16_t *q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t capacity,
                 const uint16_t *mask, float scale, uint16_t *out) {
  if (d > 512 || d % HEAD_STEP) return -2;
  return q4_attend(isa & ISA_VARIANT, amx_mode(isa, d, 0), threads, t, heads, kv_heads, d, length, 0, q, ldq, k, v,
                   capacity, mask, length, q4_first_hidden(mask, t, length, length), scale, out);
}

/* y = x / √(mean(x²) + ε), rounded to bf16, times w (Llama's RMSNorm), row by row. */
#define RMSNORM(NAME, TARGET)                                                                                        \
  TARGET static void NAME(int64_t n, const uint16_t *x, const uint16_t *w, float eps, uint16_t *y) {                 \
    float squares = 0.0f;                                                                                            \
    _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < n; i++) squares += bf(x[i]) * bf(x[i]);       \
    float inv = 1.0f / __builtin_sqrtf(squares / (float)n + eps);                                                    \
    for (int64_t i = 0; i < n; i++) y[i] = float_to_bf16(bf(float_to_bf16(bf(x[i]) * inv)) * bf(w[i]));              \
  }

/* Gemma's: y = (x / √(mean(x²) + ε)) · w in float32, rounded to bf16 once; w float32 (1 + the
 * stored weight, folded in by the caller). */
#define RMSNORM_F(NAME, TARGET)                                                                                      \
  TARGET static void NAME(int64_t n, const uint16_t *x, const float *w, float eps, uint16_t *y) {                   \
    float squares = 0.0f;                                                                                            \
    _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < n; i++) squares += bf(x[i]) * bf(x[i]);       \
    float inv = 1.0f / __builtin_sqrtf(squares / (float)n + eps);                                                    \
    for (int64_t i = 0; i < n; i++) y[i] = float_to_bf16(bf(x[i]) * inv * w[i]);                                    \
  }

RMSNORM(rmsnorm512, T512)
RMSNORM(rmsnorm256, T256)
RMSNORM_F(rmsnorm512_f, T512)
RMSNORM_F(rmsnorm256_f, T256)

/* rows of x (row stride ldx) → y (rows × n); w: bf16 (Llama's norm) or, with `wide`, float32 (Gemma's).
 * x and y may be the same rows (ldx = n). */
void q4_rmsnorm(int isa, int64_t rows, int64_t n, const uint16_t *x, int64_t ldx, const void *w, int wide, float eps,
                uint16_t *y) {
  for (int64_t r = 0; r < rows; r++) {
    if (wide)
      (isa == 2 ? rmsnorm512_f : rmsnorm256_f)(n, x + r * ldx, (const float *)w, eps, y + r * n);
    else
      (isa == 2 ? rmsnorm512 : rmsnorm256)(n, x + r * ldx, (const uint16_t *)w, eps, y + r * n);
  }
}

