/* A decoding step's attention and RMSNorm in bf16, and whole decoder layers.
 *
 * Every row is computed on its own, in the same order whatever else the step holds: a tree's
 * node gets the bits a one-token step over the same keys would. Written as plain loops that
 * the compiler vectorizes for each target (T512, T256).
 */
#include "common.h"

static inline float exp_neg(float x) { /* e^x for x <= 0, to about 2 ulp (0 below -87) */
  x = x < -87.0f ? -87.0f : x;
  float n = __builtin_rintf(x * 1.44269504f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

static inline float bf(uint16_t b) { return bf16_to_float(b); }

/* Attention of up to LANES queries that share a kv head (query l is lane l), against keys and
 * values [0, length): every lane sums over d and over the keys in the same order whatever the
 * other lanes hold, and a key a query does not see adds an exact 0, so a tree's node and a
 * one-token step that see the same keys get the same bits. Keys before `open` are seen by every
 * lane; from there on mask[l][j] says (0: seen). work: length·LANES + d·LANES + d floats. */
#define LANES 16
#define ATTEND(NAME, TARGET)                                                                                         \
  TARGET static void NAME(int64_t lanes, int64_t d, const uint16_t *const *q, const uint16_t *k, const uint16_t *v,  \
                          int64_t length, int64_t open, const uint16_t *const *mask, float scale, float *work,      \
                          uint16_t *const *out) {                                                                   \
    float *scores = work, *qt = scores + length * LANES, *acc = qt; /* acc reuses qt once scores are done */       \
    float *row = qt + d * LANES;                                                                                     \
    for (int64_t i = 0; i < d; i++)                                                                                  \
      for (int l = 0; l < LANES; l++) qt[i * LANES + l] = l < lanes ? bf(q[l][i]) * scale : 0.0f;                   \
    float top[LANES];                                                                                                \
    for (int l = 0; l < LANES; l++) top[l] = -INFINITY;                                                              \
    int64_t j = 0;                                                                                                   \
    for (; j + 4 <= length; j += 4) { /* four keys at once: four independent sums */                                \
      float s0[LANES] = {0}, s1[LANES] = {0}, s2[LANES] = {0}, s3[LANES] = {0};                                      \
      const uint16_t *kj = k + j * d;                                                                                \
      for (int64_t i = 0; i < d; i++) {                                                                              \
        float k0 = bf(kj[i]), k1 = bf(kj[d + i]), k2 = bf(kj[2 * d + i]), k3 = bf(kj[3 * d + i]);                    \
        const float *qi = qt + i * LANES;                                                                            \
        _Pragma("omp simd") for (int l = 0; l < LANES; l++) {                                                       \
          s0[l] += qi[l] * k0;                                                                                       \
          s1[l] += qi[l] * k1;                                                                                       \
          s2[l] += qi[l] * k2;                                                                                       \
          s3[l] += qi[l] * k3;                                                                                       \
        }                                                                                                            \
      }                                                                                                              \
      _Pragma("omp simd") for (int l = 0; l < LANES; l++) {                                                         \
        scores[j * LANES + l] = s0[l];                                                                               \
        scores[(j + 1) * LANES + l] = s1[l];                                                                         \
        scores[(j + 2) * LANES + l] = s2[l];                                                                         \
        scores[(j + 3) * LANES + l] = s3[l];                                                                         \
      }                                                                                                              \
    }                                                                                                                \
    for (; j < length; j++) {                                                                                        \
      float s0[LANES] = {0};                                                                                         \
      const uint16_t *kj = k + j * d;                                                                                \
      for (int64_t i = 0; i < d; i++) {                                                                              \
        float k0 = bf(kj[i]);                                                                                        \
        _Pragma("omp simd") for (int l = 0; l < LANES; l++) s0[l] += qt[i * LANES + l] * k0;                         \
      }                                                                                                              \
      _Pragma("omp simd") for (int l = 0; l < LANES; l++) scores[j * LANES + l] = s0[l];                            \
    }                                                                                                                \
    for (j = open; j < length; j++) /* the keys some lanes do not see */                                            \
      for (int l = 0; l < LANES; l++)                                                                                \
        if (l >= lanes || (mask[l] && (mask[l][j] & 0x7fff) != 0)) scores[j * LANES + l] = -INFINITY;              \
    for (j = 0; j < length; j++) {                                                                                   \
      _Pragma("omp simd") for (int l = 0; l < LANES; l++) top[l] = scores[j * LANES + l] > top[l] ? scores[j * LANES + l] : top[l]; \
    }                                                                                                                \
    float total[LANES] = {0};                                                                                        \
    for (j = 0; j < length; j++) {                                                                                   \
      _Pragma("omp simd") for (int l = 0; l < LANES; l++) {                                                         \
        float x = scores[j * LANES + l];                                                                             \
        float p = x == -INFINITY ? 0.0f : exp_neg(x - top[l]);                                                       \
        scores[j * LANES + l] = p;                                                                                   \
        total[l] += p;                                                                                               \
      }                                                                                                              \
    }                                                                                                                \
    for (int64_t i = 0; i < d * LANES; i++) acc[i] = 0.0f;                                                           \
    for (j = 0; j < length; j++) {                                                                                   \
      const uint16_t *vj = v + j * d;                                                                                \
      const float *pj = scores + j * LANES;                                                                          \
      for (int64_t i = 0; i < d; i++) row[i] = bf(vj[i]);                                                            \
      for (int64_t i = 0; i < d; i++) {                                                                              \
        float x = row[i];                                                                                            \
        _Pragma("omp simd") for (int l = 0; l < LANES; l++) acc[i * LANES + l] += pj[l] * x;                         \
      }                                                                                                              \
    }                                                                                                                \
    for (int64_t l = 0; l < lanes; l++) {                                                                            \
      float inv = 1.0f / total[l];                                                                                   \
      for (int64_t i = 0; i < d; i++) out[l][i] = float_to_bf16(acc[i * LANES + l] * inv);                          \
    }                                                                                                                \
  }

ATTEND(attend512, T512)
ATTEND(attend256, T256)

/* out (t × heads × d) for queries q (t × heads × d, row stride ldq) against keys and values
 * (kv_heads × capacity × d, the first `length` used); query head h reads kv head h / (heads /
 * kv_heads). mask: t × length bf16, 0 where a query sees a key (NULL: every key is seen); keys
 * before `open` are seen by every query (q4_attention finds it). Returns 0, or -1 when scratch
 * memory could not be had. */
static int attention(int isa, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
                     const uint16_t *q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t capacity,
                     const uint16_t *mask, int64_t open, float scale, uint16_t *out) {
  int64_t group = heads / kv_heads, queries = t * group, blocks = (queries + LANES - 1) / LANES;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (t * heads * length >= 1024)
  {
    float *work = malloc(sizeof(float) * (size_t)(length * LANES + d * LANES + d));
    if (!work) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static) collapse(2)
    for (int64_t g = 0; g < kv_heads; g++)
      for (int64_t b = 0; b < blocks; b++) {
        if (!work) continue;
        const uint16_t *qs[LANES], *ms[LANES];
        uint16_t *os[LANES];
        int64_t lanes = queries - b * LANES < LANES ? queries - b * LANES : LANES;
        for (int64_t l = 0; l < LANES; l++) { /* query (row r, head g·group + h) */
          int64_t r = (b * LANES + l) / group, h = g * group + (b * LANES + l) % group;
          qs[l] = l < lanes ? q + r * ldq + h * d : 0;
          ms[l] = l < lanes && mask ? mask + r * length : 0;
          os[l] = l < lanes ? out + (r * heads + h) * d : 0;
        }
        (isa == 2 ? attend512 : attend256)(lanes, d, qs, k + g * capacity * d, v + g * capacity * d, length,
                                           open, ms, scale, work, os);
      }
    free(work);
  }
  return failed ? -1 : 0;
}

/* The first key some query does not see (length when every query sees every key). */
static int64_t first_hidden(const uint16_t *mask, int64_t t, int64_t length) {
  if (!mask) return length;
  for (int64_t j = 0; j < length; j++)
    for (int64_t r = 0; r < t; r++)
      if ((mask[r * length + j] & 0x7fff) != 0) return j;
  return length;
}

int q4_attention(int isa, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
                 const uint16_t *q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t capacity,
                 const uint16_t *mask, float scale, uint16_t *out) {
  return attention(isa, threads, t, heads, kv_heads, d, length, q, ldq, k, v, capacity, mask,
                   first_hidden(mask, t, length), scale, out);
}

/* y = x / √(mean(x²) + ε), rounded to bf16, times w (Llama's RMSNorm), row by row. */
#define RMSNORM(NAME, TARGET)                                                                                        \
  TARGET static void NAME(int64_t n, const uint16_t *x, const uint16_t *w, float eps, uint16_t *y) {                \
    float squares = 0.0f;                                                                                            \
    _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < n; i++) squares += bf(x[i]) * bf(x[i]);      \
    float inv = 1.0f / __builtin_sqrtf(squares / (float)n + eps);                                                    \
    for (int64_t i = 0; i < n; i++) y[i] = float_to_bf16(bf(float_to_bf16(bf(x[i]) * inv)) * bf(w[i]));             \
  }

RMSNORM(rmsnorm512, T512)
RMSNORM(rmsnorm256, T256)

void q4_rmsnorm(int isa, int64_t rows, int64_t n, const uint16_t *x, int64_t ldx, const uint16_t *w, float eps,
                uint16_t *y) {
  for (int64_t r = 0; r < rows; r++) (isa == 2 ? rmsnorm512 : rmsnorm256)(n, x + r * ldx, w, eps, y + r * n);
}

/* ---------------------------------------------------------------- whole decoder layers */

/* One Llama-family decoder layer's weights (core/q4.py's Block): RMSNorm → GQA attention with
 * rotary positions → RMSNorm → SwiGLU MLP, q/k/v and gate/up fused. */
typedef struct {
  const uint16_t *norm1, *norm2; /* bf16, hidden */
  const q4_layer *qkv, *o, *gate_up, *down;
} q4_block;

typedef struct {
  int64_t layers, hidden, heads, kv_heads, head_dim, inner;
  float eps;
  const q4_block *blocks;
} q4_model;

static inline float silu(float g) { /* g·σ(g), through e^x for x <= 0 */
  float e = exp_neg(g >= 0.0f ? -g : g);
  return g >= 0.0f ? g / (1.0f + e) : g * e / (1.0f + e);
}

#define ELEMENTWISE(NAME, TARGET)                                                                                    \
  TARGET static void NAME##_add(int64_t n, uint16_t *x, const uint16_t *y) {                                       \
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++) x[i] = float_to_bf16(bf(x[i]) + bf(y[i]));                   \
  }                                                                                                                  \
  TARGET static void NAME##_swiglu(int64_t n, const uint16_t *g, const uint16_t *u, uint16_t *m) {                 \
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++) m[i] = float_to_bf16(bf(float_to_bf16(silu(bf(g[i])))) * bf(u[i])); \
  }                                                                                                                  \
  TARGET static void NAME##_rope(int64_t heads, int64_t d, uint16_t *x, const uint16_t *cos, const uint16_t *sin) { \
    float row[512];                                                                                                  \
    int64_t half = d / 2;                                                                                            \
    for (int64_t h = 0; h < heads; h++) {                                                                            \
      uint16_t *xh = x + h * d;                                                                                      \
      for (int64_t i = 0; i < d; i++) row[i] = bf(xh[i]);                                                            \
      _Pragma("omp simd") for (int64_t i = 0; i < d; i++) {                                                         \
        float turned = i < half ? row[i + half] : row[i - half];                                                     \
        xh[i] = float_to_bf16(row[i] * bf(cos[i]) + turned * bf(sin[i]));                                            \
      }                                                                                                              \
    }                                                                                                                \
  }

ELEMENTWISE(e512, T512)
ELEMENTWISE(e256, T256)

/* t rows of the residual stream x (t × hidden, bf16, in and out) through every layer. cos, sin:
 * t × head_dim bf16 (sin's first half negated); keys, values: layers × kv_heads × capacity ×
 * head_dim bf16, rows [past, past + t) written; mask: t × (past + t) bf16 (0: seen) or NULL
 * (every row sees every key). Returns 0, or -1 when scratch memory could not be had. */
int q4_decode(const q4_model *model, int isa, int threads, int64_t t, uint16_t *x, const uint16_t *cos,
              const uint16_t *sin, int64_t past, const uint16_t *mask, uint16_t *keys, uint16_t *values,
              int64_t capacity) {
  int64_t hidden = model->hidden, d = model->head_dim, heads = model->heads, kv = model->kv_heads;
  int64_t q = heads * d, width = q + 2 * kv * d, inner = model->inner, length = past + t;
  if (d > 512) return -2;
  uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(t * (hidden + width + q + hidden + 2 * inner + inner)));
  if (!h) return -1;
  uint16_t *qkv = h + t * hidden, *a = qkv + t * width, *o = a + t * q, *gu = o + t * hidden, *m = gu + t * 2 * inner;
  int code = 0;
  int64_t open = first_hidden(mask, t, length);
  for (int64_t layer = 0; layer < model->layers && !code; layer++) {
    const q4_block *b = model->blocks + layer;
    uint16_t *kl = keys + layer * kv * capacity * d, *vl = values + layer * kv * capacity * d;
    q4_rmsnorm(isa, t, hidden, x, hidden, b->norm1, model->eps, h);
    code |= q4_run(b->qkv, isa, threads, t, h, hidden, qkv);
    for (int64_t r = 0; r < t; r++) {
      uint16_t *row = qkv + r * width;
      (isa == 2 ? e512_rope : e256_rope)(heads + kv, d, row, cos + r * d, sin + r * d);
      for (int64_t g = 0; g < kv; g++) {
        memcpy(kl + (g * capacity + past + r) * d, row + q + g * d, sizeof(uint16_t) * (size_t)d);
        memcpy(vl + (g * capacity + past + r) * d, row + q + (kv + g) * d, sizeof(uint16_t) * (size_t)d);
      }
    }
    code |= attention(isa, threads, t, heads, kv, d, length, qkv, width, kl, vl, capacity, mask, open,
                      1.0f / sqrtf((float)d), a);
    code |= q4_run(b->o, isa, threads, t, a, q, o);
    (isa == 2 ? e512_add : e256_add)(t * hidden, x, o);
    q4_rmsnorm(isa, t, hidden, x, hidden, b->norm2, model->eps, h);
    code |= q4_run(b->gate_up, isa, threads, t, h, hidden, gu);
    for (int64_t r = 0; r < t; r++)
      (isa == 2 ? e512_swiglu : e256_swiglu)(inner, gu + r * 2 * inner, gu + r * 2 * inner + inner, m + r * inner);
    code |= q4_run(b->down, isa, threads, t, m, inner, o);
    (isa == 2 ? e512_add : e256_add)(t * hidden, x, o);
  }
  free(h);
  return code ? -1 : 0;
}
