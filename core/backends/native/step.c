/* A decoding step's attention and RMSNorm in bf16, and whole decoder layers.
 *
 * Every row is computed on its own, in the same order whatever else the step holds: a tree's
 * node gets the bits a one-token step over the same keys would. Written as plain loops that
 * the compiler vectorizes for each target (T512, T256).
 */
#include "common.h"

static inline float bf(uint16_t b) { return bf16_to_float(b); }

/* The two hot loops of attention in explicit vectors, for head sizes the vector width divides.
 * scores: s[m·padded + jj] = q_m · key jj for the KEYS keys of a block (rows of `block`), each
 * dot product as one vector of partial sums that a butterfly over the block's keys then adds up:
 * every key's lanes are added in the same pattern whatever its slot. values: acc_m += p_m[jj] ·
 * value jj and total_m += p_m[jj], key after key. */
#define ALWAYS static inline __attribute__((always_inline))

/* r[jj] (jj < W) = the lane-wise partial sums of q · key jj over the head (d = W·D floats a
 * row), for the keys at `keys`: one product, then D - 1 fused adds, the same for every key. */
#define PARTIALS(P, W, r, q, keys)                                                                                   \
  for (int jj = 0; jj < W; jj++) {                                                                                   \
    const float *kj = (keys) + jj * d;                                                                               \
    r[jj] = P##_mul_ps(P##_loadu_ps(q), P##_loadu_ps(kj));                                                           \
    for (int64_t c = 1; c < D; c++) r[jj] = P##_fmadd_ps(P##_loadu_ps((q) + W * c), P##_loadu_ps(kj + W * c), r[jj]); \
  }

T512 ALWAYS void scores512_d(int64_t n, int64_t D, const float *qf, const float *block, float *s, int64_t padded) {
  static const int order[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  const __m512i back = _mm512_loadu_si512(order);
  int64_t d = 16 * D;
  for (int64_t m = 0; m < n; m++) {
    __m512 r[16], w[8];
    const float *qm = qf + m * d;
    PARTIALS(_mm512, 16, r, qm, block);
    for (int i = 0; i < 8; i++)
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[i], r[i + 8], 0x44), _mm512_shuffle_f32x4(r[i], r[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
      w[i] = _mm512_add_ps(_mm512_shuffle_ps(w[i], w[i + 2], 0x44), _mm512_shuffle_ps(w[i], w[i + 2], 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    _mm512_storeu_ps(s + m * padded, _mm512_permutexvar_ps(back, z));
  }
}

T512 static void scores512(int64_t n, int64_t d, const float *qf, const float *block, float *s, int64_t padded) {
  if (d == 64)
    scores512_d(n, 4, qf, block, s, padded);
  else if (d == 128)
    scores512_d(n, 8, qf, block, s, padded);
  else
    scores512_d(n, d / 16, qf, block, s, padded);
}

/* The same for 8 lanes: KEYS keys as two butterflies of 8. */
T256 ALWAYS void scores256_d(int64_t n, int64_t D, const float *qf, const float *block, float *s, int64_t padded) {
  int64_t d = 8 * D;
  for (int64_t m = 0; m < n; m++)
    for (int half = 0; half < 2; half++) {
      __m256 r[8];
      const float *qm = qf + m * d;
      PARTIALS(_mm256, 8, r, qm, block + 8 * half * d);
      for (int i = 0; i < 4; i++)
        r[i] = _mm256_add_ps(_mm256_permute2f128_ps(r[i], r[i + 4], 0x20), _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      for (int i = 0; i < 2; i++)
        r[i] = _mm256_add_ps(_mm256_shuffle_ps(r[i], r[i + 2], 0x44), _mm256_shuffle_ps(r[i], r[i + 2], 0xEE));
      __m256 z = _mm256_add_ps(_mm256_shuffle_ps(r[0], r[1], 0x88), _mm256_shuffle_ps(r[0], r[1], 0xDD));
      _mm256_storeu_ps(s + m * padded + 8 * half, _mm256_shuffle_ps(z, z, 0xD8));
    }
}

T256 static void scores256(int64_t n, int64_t d, const float *qf, const float *block, float *s, int64_t padded) {
  if (d == 64)
    scores256_d(n, 8, qf, block, s, padded);
  else
    scores256_d(n, d / 8, qf, block, s, padded);
}

/* values: for each query m, acc_m += p_m[jj] · value jj and total_m += p_m[jj], key after key
 * (`stop` keys of a block), W lanes a vector (P: the intrinsics' prefix). */
#define VALUES(NAME, TARGET, VEC, W, P)                                                                              \
  TARGET ALWAYS void NAME##_d(int64_t n, int64_t D, int64_t stop, const float *p, int64_t padded, const float *block, \
                              float *acc, float *total) {                                                           \
    int64_t d = W * D;                                                                                               \
    for (int64_t m = 0; m < n; m++)                                                                                  \
      for (int64_t c0 = 0; c0 < D; c0 += 8) { /* up to 8 vectors of a row at a time */                             \
        int64_t width = D - c0 < 8 ? D - c0 : 8;                                                                     \
        VEC a[8];                                                                                                    \
        const float *pm = p + m * padded;                                                                            \
        float tm = total[m];                                                                                         \
        for (int64_t c = 0; c < width; c++) a[c] = P##_loadu_ps(acc + m * d + W * (c0 + c));                        \
        for (int64_t jj = 0; jj < stop; jj++) {                                                                      \
          VEC pj = P##_set1_ps(pm[jj]);                                                                              \
          tm += pm[jj];                                                                                              \
          for (int64_t c = 0; c < width; c++) a[c] = P##_fmadd_ps(pj, P##_loadu_ps(block + jj * d + W * (c0 + c)), a[c]); \
        }                                                                                                            \
        for (int64_t c = 0; c < width; c++) P##_storeu_ps(acc + m * d + W * (c0 + c), a[c]);                       \
        if (c0 == 0) total[m] = tm;                                                                                  \
      }                                                                                                              \
  }                                                                                                                  \
  TARGET static void NAME(int64_t n, int64_t d, int64_t stop, const float *p, int64_t padded, const float *block,   \
                          float *acc, float *total) { /* the common head sizes with their loops' bounds known */    \
    if (d == 64)                                                                                                     \
      NAME##_d(n, 64 / W, stop, p, padded, block, acc, total);                                                       \
    else if (d == 128)                                                                                               \
      NAME##_d(n, 128 / W, stop, p, padded, block, acc, total);                                                      \
    else                                                                                                             \
      NAME##_d(n, d / W, stop, p, padded, block, acc, total);                                                        \
  }

VALUES(values512, T512, __m512, 16, _mm512)
VALUES(values256, T256, __m256, 8, _mm256)

/* Attention of up to QUERIES queries that share a kv head, against keys and values [0, length).
 * Each score is one query's dot product with one key over d, made by the same instructions
 * whatever slot the key has or which other queries are in the call; softmax weights then sum
 * over the keys in order, and a key a query does not see adds an exact 0: a tree's node and a
 * one-token step that see the same keys get the same bits. Keys before `open` are seen by every
 * query; from there on mask[m][j] says (0: seen). The work is proportional to the queries (a
 * one-token step's 3 queries do not pay for 16 lanes). work: ATTEND_WORK(n, d, length) floats. */
#define QUERIES 48 /* the most queries one pass over a kv head's keys and values serves */
#define SPLIT 4     /* the fewest queries a block is split down to, to share out the blocks */
#define HEAD_STEP 16 /* head sizes must be multiples of this (core/q4.py HEAD_STEP) */
#define KEYS 16
#define PADDED(length) (((length) + KEYS - 1) / KEYS * KEYS)
#define ATTEND_WORK(n, d, length) ((n) * (2 * (d) + PADDED(length) + 1) + KEYS * (d))
#define ATTEND(NAME, SCORES, VALUES, TARGET)                                                                         \
  TARGET static void NAME(int64_t n, int64_t d, const uint16_t *const *q, const uint16_t *k, const uint16_t *v,      \
                          int64_t length, int64_t open, const uint16_t *const *mask, float scale, float *work,       \
                          uint16_t *const *out) {                                                                    \
    int64_t padded = PADDED(length);                                                                                 \
    float *qf = work, *acc = qf + n * d, *scores = acc + n * d, *total = scores + n * padded;                        \
    float *block = total + n;                                                                                        \
    for (int64_t m = 0; m < n; m++) {                                                                                \
      _Pragma("omp simd") for (int64_t i = 0; i < d; i++) qf[m * d + i] = bf(q[m][i]) * scale;                       \
    }                                                                                                                \
    for (int64_t j0 = 0; j0 < padded; j0 += KEYS) { /* scores, KEYS keys at a time */                                \
      for (int64_t jj = 0; jj < KEYS; jj++) {                                                                        \
        const uint16_t *kj = k + (j0 + jj) * d;                                                                      \
        float *bj = block + jj * d;                                                                                  \
        if (j0 + jj < length) {                                                                                      \
          _Pragma("omp simd") for (int64_t i = 0; i < d; i++) bj[i] = bf(kj[i]);                                     \
        } else {                                                                                                     \
          for (int64_t i = 0; i < d; i++) bj[i] = 0.0f;                                                              \
        }                                                                                                            \
      }                                                                                                              \
      SCORES(n, d, qf, block, scores + j0, padded);                                                                  \
    }                                                                                                                \
    for (int64_t m = 0; m < n; m++) { /* softmax weights, unnormalized */                                            \
      float *sm = scores + m * padded, top = -INFINITY;                                                              \
      if (mask[m])                                                                                                   \
        for (int64_t j = open; j < length; j++)                                                                      \
          if ((mask[m][j] & 0x7fff) != 0) sm[j] = -INFINITY;                                                         \
      for (int64_t j = length; j < padded; j++) sm[j] = -INFINITY;                                                   \
      _Pragma("omp simd reduction(max : top)") for (int64_t j = 0; j < padded; j++) top = sm[j] > top ? sm[j] : top; \
      for (int64_t j0 = 0; j0 < padded; j0 += KEYS) {                                                                \
        _Pragma("omp simd") for (int64_t l = 0; l < KEYS; l++) {                                                     \
          float x = sm[j0 + l];                                                                                      \
          sm[j0 + l] = x == -INFINITY ? 0.0f : exp_neg(x - top);                                                     \
        }                                                                                                            \
      }                                                                                                              \
      total[m] = 0.0f;                                                                                               \
      for (int64_t i = 0; i < d; i++) acc[m * d + i] = 0.0f;                                                         \
    }                                                                                                                \
    for (int64_t j0 = 0; j0 < length; j0 += KEYS) { /* weighted values, key by key in order */                       \
      int64_t stop = length - j0 < KEYS ? length - j0 : KEYS;                                                        \
      for (int64_t jj = 0; jj < stop; jj++) {                                                                        \
        const uint16_t *vj = v + (j0 + jj) * d;                                                                      \
        _Pragma("omp simd") for (int64_t i = 0; i < d; i++) block[jj * d + i] = bf(vj[i]);                           \
      }                                                                                                              \
      VALUES(n, d, stop, scores + j0, padded, block, acc, total);                                                    \
    }                                                                                                                \
    for (int64_t m = 0; m < n; m++) {                                                                                \
      float inv = 1.0f / total[m];                                                                                   \
      for (int64_t i = 0; i < d; i++) out[m][i] = float_to_bf16(acc[m * d + i] * inv);                               \
    }                                                                                                                \
  }

ATTEND(attend512, scores512, values512, T512)
ATTEND(attend256, scores256, values256, T256)

/* out (t × heads × d) for queries q (t × heads × d, row stride ldq) against keys and values
 * (kv_heads × capacity × d, the first `length` used); query head h reads kv head h / (heads /
 * kv_heads). mask: t rows of ldm bf16 (the first `length` used), 0 where a query sees a key (NULL: every
 * key is seen); keys
 * before `open` are seen by every query (q4_attention finds it). Returns 0, or -1 when scratch
 * memory could not be had. */
int q4_attend(int isa, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
                     const uint16_t *q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t capacity,
                     const uint16_t *mask, int64_t ldm, int64_t open, float scale, uint16_t *out) {
  /* Each block of queries reads and converts its kv head's keys and values once, so blocks are
   * as large as QUERIES allows, and as many as give every thread the same number of them, while
   * a block keeps SPLIT queries (a one-token step's 3 would pay the conversion twice for nothing). */
  int64_t group = heads / kv_heads, queries = t * group, per = (queries + QUERIES - 1) / QUERIES;
  while ((kv_heads * per) % threads && (queries + per) / (per + 1) >= SPLIT) per++;
  int64_t size = (queries + per - 1) / per, blocks = (queries + size - 1) / size;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (t * heads * length >= 1024)
  {
    float *work = malloc(sizeof(float) * (size_t)ATTEND_WORK(size, d, length));
    if (!work) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static) collapse(2)
    for (int64_t g = 0; g < kv_heads; g++)
      for (int64_t b = 0; b < blocks; b++) {
        if (!work) continue;
        const uint16_t *qs[QUERIES], *ms[QUERIES];
        uint16_t *os[QUERIES];
        int64_t n = queries - b * size < size ? queries - b * size : size;
        for (int64_t l = 0; l < n; l++) { /* query (row r, head g·group + h) */
          int64_t r = (b * size + l) / group, h = g * group + (b * size + l) % group;
          qs[l] = q + r * ldq + h * d;
          ms[l] = mask ? mask + r * ldm : 0;
          os[l] = out + (r * heads + h) * d;
        }
        (isa == 2 ? attend512 : attend256)(n, d, qs, k + g * capacity * d, v + g * capacity * d, length, open, ms,
                                           scale, work, os);
      }
    free(work);
  }
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
  return q4_attend(isa, threads, t, heads, kv_heads, d, length, q, ldq, k, v, capacity, mask, length,
                   q4_first_hidden(mask, t, length, length), scale, out);
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

