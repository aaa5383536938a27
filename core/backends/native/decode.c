/* Whole decoder layers in one call: every layer of a decoding step (up to 64 rows) through the
 * q4 matmuls and step.c's norms and attention.
 *
 * The layers of Llama, Mistral and Qwen2 (RMSNorm → GQA attention with rotary positions →
 * RMSNorm → SwiGLU MLP), Qwen3 (the same with an RMSNorm over each head of q and k before the
 * rotation) and Gemma 3 (norms x·(1 + w) in float32; q/k head norms; a norm on the attention's
 * and on the MLP's output before each residual add; a GELU-tanh gated MLP; sliding-window layers
 * with their own rotary table). Every row is computed on its own, as in step.c.
 */
#include "common.h"
#include <omp.h>

static inline float bf(uint16_t b) { return bf16_to_float(b); }

/* One decoder layer's weights (core/q4.py's Block), q/k/v and gate/up fused. Norm weights are
 * bf16, or float32 (1 + w) in a Gemma model; q_norm, k_norm (head_dim), post_attn and post_mlp
 * (hidden) may be NULL. window: a sliding-window layer's window (a row at position p sees the
 * keys at positions > p - window), 0 for full attention; rope: which rotary table it reads. */
typedef struct {
  const void *norm1, *norm2;
  const q4_layer *qkv, *o, *gate_up, *down;
  const void *q_norm, *k_norm, *post_attn, *post_mlp;
  int64_t window, rope;
} q4_block;

typedef struct {
  int64_t layers, hidden, heads, kv_heads, head_dim, inner;
  float eps, scale; /* scale: the attention's (d^-0.5, or Gemma's query_pre_attn_scalar^-0.5) */
  int64_t gemma;    /* norms as Gemma's (float32 weights, one rounding) */
  int64_t act;      /* the MLP's gate: 0 SiLU, 1 GELU (tanh approximation) */
  const q4_block *blocks;
} q4_model;

#define GELU_K 1.5957691216057308f /* GELU-tanh: ½g(1 + tanh u) = g·σ(2u), 2u = GELU_K·(g + 0.044715g³) */

#define ELEMENTWISE(NAME, TARGET, VEC, W, P, LOAD_BF, ROUND_BF, STORE_BF, EXPS)                                                \
  TARGET static void NAME##_add(int64_t n, uint16_t *x, const uint16_t *y) {                                         \
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++) x[i] = float_to_bf16(bf(x[i]) + bf(y[i]));                   \
  }                                                                                                                  \
  /* m = act(g)·u (n a multiple of W), act(g) = g·σ(z) rounded to bf16 as torch's bf16 activation is, z = g     \
   * (SiLU) or 2u (GELU-tanh), whose sign is g's; σ(z) through e^-|z| in vectors (z: scratch of n rounded up to   \
   * 16 floats). */                                                                                                 \
  TARGET static void NAME##_glu(int64_t n, int gelu, const uint16_t *g, const uint16_t *u, uint16_t *m, float *z) {  \
    const VEC zero = P##_setzero_ps(), one = P##_set1_ps(1.0f), k = P##_set1_ps(GELU_K), c = P##_set1_ps(0.044715f); \
    for (int64_t i = 0; i < n; i += W) {                                                                             \
      VEC x = LOAD_BF(g + i), a = x;                                                                                 \
      if (gelu) a = P##_mul_ps(k, P##_fmadd_ps(P##_mul_ps(c, x), P##_mul_ps(x, x), x));                              \
      P##_storeu_ps(z + i, P##_min_ps(a, P##_sub_ps(zero, a)));                                                      \
    }                                                                                                                \
    EXPS((n + 15) / 16 * 16, z);                                                                                     \
    for (int64_t i = 0; i < n; i += W) {                                                                             \
      VEC x = LOAD_BF(g + i), e = P##_loadu_ps(z + i);                                                               \
      VEC act = P##_div_ps(NAME##_pick(x, x, P##_mul_ps(x, e)), P##_add_ps(one, e));                                 \
      STORE_BF(m + i, ROUND_BF(P##_mul_ps(ROUND_BF(act), LOAD_BF(u + i))));                                      \
    }                                                                                                                \
  }                                                                                                                  \
  TARGET static void NAME##_rope(int64_t heads, int64_t d, uint16_t *x, const uint16_t *cos, const uint16_t *sin) {  \
    float row[512];                                                                                                  \
    int64_t half = d / 2;                                                                                            \
    for (int64_t h = 0; h < heads; h++) {                                                                            \
      uint16_t *xh = x + h * d;                                                                                      \
      for (int64_t i = 0; i < d; i++) row[i] = bf(xh[i]);                                                            \
      _Pragma("omp simd") for (int64_t i = 0; i < d; i++) {                                                          \
        float turned = i < half ? row[i + half] : row[i - half];                                                     \
        xh[i] = float_to_bf16(row[i] * bf(cos[i]) + turned * bf(sin[i]));                                            \
      }                                                                                                              \
    }                                                                                                                \
  }

T512 static inline __m512 e512_pick(__m512 a, __m512 yes, __m512 no) { /* a >= 0 ? yes : no */
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ), no, yes);
}
T256 static inline __m256 e256_pick(__m256 a, __m256 yes, __m256 no) {
  return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ));
}
ELEMENTWISE(e512, T512, __m512, 16, _mm512, LOAD_BF512, round_bf512, store_bf512, exps512)
ELEMENTWISE(e256, T256, __m256, 8, _mm256, LOAD_BF256, round_bf256, store_bf256, exps256)

/* The keys a sliding-window layer's rows see, over keys [*lo, length): the keys before *lo are
 * seen by no row (they are skipped: an unseen key adds nothing, so this changes no bits). A key
 * at index j < past sits at position j; the t new rows' keys at `positions`. Returns the mask
 * (t × (length - *lo), written into `room`), or NULL where every row sees every key from *lo on
 * (a one-token step). */
static const uint16_t *window_mask(int64_t t, int64_t past, int64_t length, const int64_t *positions,
                                   const uint16_t *mask, int64_t window, int64_t *lo, uint16_t *room) {
  int64_t first = positions[0];
  for (int64_t r = 1; r < t; r++) first = positions[r] < first ? positions[r] : first;
  first = first - window + 1;
  *lo = first < 0 ? 0 : first > past ? past : first;
  int64_t width = length - *lo, hidden = 0;
  for (int64_t r = 0; r < t; r++)
    for (int64_t j = *lo; j < length; j++) {
      int64_t at = j < past ? j : positions[j - past];
      int off = (mask && (mask[r * length + j] & 0x7fff)) || at <= positions[r] - window;
      room[r * width + j - *lo] = off ? 0xff80 : 0; /* -inf */
      hidden |= off;
    }
  return hidden ? room : NULL;
}

/* A block's row-wise work (norms, rotations, cache writes, gates, adds: each row on its own, so
 * the same bits on any thread) is spread over the threads from this many rows (a prompt's block:
 * on one thread it left the other idle ~16 % of a 4,000-token read); fewer rows stay on one. */
#define SPREAD_ROWS 16

/* Row r of x (row stride ldx): an RMSNorm over each of its `heads` groups of d in place. */
static void head_norm(const q4_model *model, int isa, int64_t r, int64_t ldx, uint16_t *x, int64_t heads,
                      const void *w) {
  q4_rmsnorm(isa, heads, model->head_dim, x + r * ldx, model->head_dim, w, (int)model->gemma, model->eps,
             x + r * ldx);
}

/* Row by row, the rows spread over the threads (SPREAD_ROWS): y = post(y) where `post` (a norm's
 * weight, as q4_rmsnorm's), then x += y where y, then h = norm(x) where `norm`. */
static void residual(int isa, int threads, int64_t t, int64_t n, uint16_t *x, uint16_t *y, const void *post,
                     const void *norm, int wide, float eps, uint16_t *h) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= SPREAD_ROWS)
  for (int64_t r = 0; r < t; r++) {
    if (post) q4_rmsnorm(isa, 1, n, y + r * n, n, post, wide, eps, y + r * n);
    if (y) (isa == 2 ? e512_add : e256_add)(n, x + r * n, y + r * n);
    if (norm) q4_rmsnorm(isa, 1, n, x + r * n, n, norm, wide, eps, h + r * n);
  }
}

/* Layer `layer`'s attention: norms and rotation of q and k, the cache writes, attention → a. */
static int attend(const q4_model *model, const q4_block *b, int isa, int kv8, int amx, int threads, int64_t t,
                  uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, const int64_t *positions, int64_t past,
                  const uint16_t *mask, int64_t open, char *kl, char *vl, int64_t capacity, uint16_t *room,
                  uint16_t *a) {
  int64_t d = model->head_dim, heads = model->heads, kv = model->kv_heads, q = heads * d, width = q + 2 * kv * d;
  int64_t length = past + t;
  size_t row_bytes = kv8 ? (size_t)KV8_ROW(d) : sizeof(uint16_t) * (size_t)d;
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= SPREAD_ROWS)
  for (int64_t r = 0; r < t; r++) {
    if (b->q_norm) head_norm(model, isa, r, width, qkv, heads, b->q_norm);
    if (b->k_norm) head_norm(model, isa, r, width, qkv + q, kv, b->k_norm);
    uint16_t *row = qkv + r * width;
    (isa == 2 ? e512_rope : e256_rope)(heads + kv, d, row, cos + r * d, sin + r * d);
    for (int64_t g = 0; g < kv; g++) {
      size_t at = (size_t)(g * capacity + past + r) * row_bytes; /* its cache rows */
      char *kr = kl + at, *vr = vl + at;
      if (kv8) {
        q4_kv8_store(row + q + g * d, d, (int8_t *)kr);
        q4_kv8_store(row + q + (kv + g) * d, d, (int8_t *)vr);
      } else {
        memcpy(kr, row + q + g * d, row_bytes);
        memcpy(vr, row + q + (kv + g) * d, row_bytes);
      }
    }
  }
  if (!b->window)
    return q4_attend(isa | kv8, amx, threads, t, heads, kv, d, length, 0, qkv, width, kl, vl, capacity, mask, length,
                     open, model->scale, a);
  int64_t lo;
  const uint16_t *seen = window_mask(t, past, length, positions, mask, b->window, &lo, room);
  int64_t part = length - lo;
  return q4_attend(isa | kv8, amx, threads, t, heads, kv, d, part, lo, qkv, width, kl + lo * row_bytes,
                   vl + lo * row_bytes, capacity, seen, part, q4_first_hidden(seen, t, part, part), model->scale, a);
}

/* The stream x (t rows) after `done` layers into its column of streams (t × count × hidden) where
 * taps (count layer counts) asks for it. */
static void tap(int64_t done, int64_t t, int64_t hidden, const uint16_t *x, const int64_t *taps, int64_t count,
                uint16_t *streams) {
  for (int64_t i = 0; i < count; i++)
    if (taps[i] == done)
      for (int64_t r = 0; r < t; r++)
        memcpy(streams + (r * count + i) * hidden, x + r * hidden, sizeof(uint16_t) * (size_t)hidden);
}

/* t rows of the residual stream x (t × hidden, bf16, in and out) through every layer. cos, sin:
 * (rotary tables × t × head_dim) bf16 (sin's first half negated); positions: the t rows'
 * positions (read by sliding-window layers); keys, values: layers × kv_heads × capacity ×
 * head_dim bf16, rows [past, past + t) written; mask: t × (past + t) bf16 (0: seen) or NULL
 * (every row sees every key); isa: the variant's number, plus ISA_AMX_SCORES and ISA_AMX_VALUES
 * for attention on AMX (common.h's amx_mode); taps: `count` layer counts after which the stream
 * goes to streams (t × count × hidden: the row's streams side by side). Returns 0, or -1 when
 * scratch memory could not be had. */
int q4_decode(const q4_model *model, int isa, int threads, int64_t t, uint16_t *x, const uint16_t *cos,
              const uint16_t *sin, const int64_t *positions, int64_t past, const uint16_t *mask, void *keys,
              void *values, int64_t capacity, const int64_t *taps, int64_t count, uint16_t *streams) {
  int64_t hidden = model->hidden, d = model->head_dim, heads = model->heads, kv = model->kv_heads;
  int64_t q = heads * d, width = q + 2 * kv * d, inner = model->inner, length = past + t;
  int flags = isa, kv8 = isa & ISA_KV8; /* attention on AMX (attend_amx.c): amx_mode, layer by layer */
  isa &= ISA_VARIANT;
  size_t row_bytes = kv8 ? (size_t)KV8_ROW(d) : sizeof(uint16_t) * (size_t)d; /* a cache row's */
  if (d > 512 || d % 16) return -2;
  size_t scratch = (size_t)(t * (hidden + width + q + hidden + 2 * inner + inner) + t * length);
  uint16_t *h = malloc(sizeof(uint16_t) * scratch);
  int64_t zn = (inner + 15) / 16 * 16; /* a thread's gate scratch */
  float *z = malloc(sizeof(float) * (size_t)(zn * (threads > 1 ? threads : 1)));
  if (!h || !z) {
    free(h);
    free(z);
    return -1;
  }
  uint16_t *qkv = h + t * hidden, *a = qkv + t * width, *o = a + t * q, *gu = o + t * hidden, *m = gu + t * 2 * inner;
  uint16_t *room = m + t * inner;
  int code = 0, wide = (int)model->gemma;
  int64_t open = q4_first_hidden(mask, t, length, length);
  tap(0, t, hidden, x, taps, count, streams);
  for (int64_t layer = 0; layer < model->layers && !code; layer++) {
    const q4_block *b = model->blocks + layer;
    char *kl = (char *)keys + (size_t)(layer * kv * capacity) * row_bytes;
    char *vl = (char *)values + (size_t)(layer * kv * capacity) * row_bytes;
    const uint16_t *c = cos + b->rope * t * d, *s = sin + b->rope * t * d;
    residual(isa, threads, t, hidden, x, 0, 0, b->norm1, wide, model->eps, h);
    code |= q4_run(b->qkv, isa, threads, t, h, hidden, qkv);
    code |= attend(model, b, isa, kv8, amx_mode(flags, d, b->window), threads, t, qkv, c, s, positions, past, mask,
                   open, kl, vl, capacity, room, a);
    code |= q4_run(b->o, isa, threads, t, a, q, o);
    residual(isa, threads, t, hidden, x, o, b->post_attn, b->norm2, wide, model->eps, h);
    code |= q4_run(b->gate_up, isa, threads, t, h, hidden, gu);
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= SPREAD_ROWS)
    for (int64_t r = 0; r < t; r++) {
      const uint16_t *g = gu + r * 2 * inner, *u = g + inner;
      float *zt = z + (int64_t)omp_get_thread_num() * zn; /* this thread's scratch */
      (isa == 2 ? e512_glu : e256_glu)(inner, (int)model->act, g, u, m + r * inner, zt);
    }
    code |= q4_run(b->down, isa, threads, t, m, inner, o);
    residual(isa, threads, t, hidden, x, o, b->post_mlp, 0, wide, model->eps, h);
    tap(layer + 1, t, hidden, x, taps, count, streams);
  }
  free(h);
  free(z);
  return code ? -1 : 0;
}
