/* A decoding step's attention and RMSNorm in bf16, and whole decoder layers.
 *
 * Every row is computed on its own, in the same order whatever else the step holds: a tree's
 * node gets the bits a one-token step over the same keys would. Written as plain loops that
 * the compiler vectorizes for each target (T512, T256).
 */
#include "common.h"

static inline float bf(uint16_t b) { return bf16_to_float(b); }


/* Long key ranges are cut into parts at fixed key positions (multiples of SPLIT counted from
 * position 0, whatever the first key's position), each part's attention made on its own and
 * the parts then joined in order: top = the parts' top, each part weighted by e^(its top - top).
 * A query's bits depend on its own q and the keys it sees, so a tree's node still gets those of
 * a one-token step at its position; one row's parts go to different threads, each reading its
 * keys and values once (one thread a kv head read them 1.33-2 times over, at a third of the
 * memory's speed). SPLIT: common.h. */

/* The multiple of key positions at which the parts are cut: a tree's node gets a one-token step's
 * bits while its keys fall in the parts its one-token step's do, i.e. while the tree's slots stay
 * below the next multiple (a node's path has positions below its slots: core.backends.lean's
 * `tree_room` keeps trees there). */
int64_t q4_split(void) { return SPLIT; }

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

/* A row of d bf16 values → an 8-bit cache row (KV8_ROW): scale = the largest magnitude / 127,
 * each value rounded to the nearest multiple of it (ties to even). */
void q4_kv8_store(const uint16_t *x, int64_t d, int8_t *row) {
  float top = 0.0f;
  for (int64_t i = 0; i < d; i++) top = fabsf(bf(x[i])) > top ? fabsf(bf(x[i])) : top;
  float scale = top / 127.0f;
  for (int64_t i = 0; i < d; i++) row[i] = (int8_t)(top > 0.0f ? nearbyintf(bf(x[i]) / scale) : 0.0f);
  memcpy(row + d, &scale, sizeof scale);
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
              int64_t first, const uint16_t *q, int64_t ldq, const void *k, const void *v, int64_t capacity,
              const uint16_t *mask, int64_t ldm, int64_t open, float scale, uint16_t *out) {
  int kv8 = isa & ISA_KV8;
  size_t row = kv8 ? (size_t)KV8_ROW(d) : sizeof(uint16_t) * (size_t)d; /* a cache row's bytes */
  isa &= ISA_VARIANT;
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
  /* 8-bit values on AMX for several blocks a kv head: made into B tiles once here for all of them (the
   * dot kernel's widened to int16 pairs: attend_dot.c's q4_dot_pairs16) */
  int dot = amx & AMX_DOT, paired = kv8 && AMX_MODE(amx) == 2 && blocks > 1 && first == 0;
  int quads = paired && dot && amx & AMX_TILES; /* the values as q4_quads8's B tiles (else int16 pairs) */
  /* the tile unit used: AMX's, or the dot kernel's 8-bit integers of blocks of many queries (a
   * one-token step's few queries keep the vectors, and the tiles unconfigured) */
  int tiles = amx && (!dot || (amx & AMX_TILES && (size >= DOT_FEW || quads)));
  int64_t w32 = (length + 31) / 32 * 32; /* a kv head's rows there */
  size_t widened = (size_t)(kv_heads * w32) * (sizeof(uint16_t) * (size_t)d + sizeof(float)); /* tiles, scales */
  uint16_t *wide = paired ? malloc(widened) : 0;
  float *units = wide ? (float *)(wide + kv_heads * w32 * d) : 0;
  if (!results || (paired && !wide)) {
    free(results);
    free(wide);
    return -1;
  }
  int failed = 0;
#pragma omp parallel num_threads(threads) if (t * heads * length >= 1024)
  {
    size_t floats = (size_t)(PART_WORK(size, span) + (amx ? AMX_WORK(PADDED(span), d) : size * d));
    float *work = malloc(sizeof(float) * floats);
    if (!work) {
#pragma omp atomic write
      failed = 1;
    }
    if (wide) {
#pragma omp for schedule(static) collapse(2)
      for (int64_t g = 0; g < kv_heads; g++)
        for (int64_t j = 0; j < length; j += 256) {
          const int8_t *rows = (const int8_t *)v + (size_t)(g * capacity + j) * row;
          int64_t count = length - j < 256 ? length - j : 256;
          if (quads) /* key j's quad at j · d bytes of its head's */
            q4_quads8(rows, d, count, (uint16_t *)((int8_t *)(wide + g * w32 * d) + j * d), units + g * w32 + j);
          else
            (dot ? q4_dot_pairs16 : q4_pair_values)(rows, d, count, wide + (g * w32 + j) * d, units + g * w32 + j);
        }
    }
    if (tiles) q4_amx_begin(); /* the tile unit's configuration (AMX_DOT without AMX_TILES: none) */
#pragma omp for schedule(static) collapse(3)
    for (int64_t g = 0; g < kv_heads; g++) /* a thread's tasks in order: a part's blocks one after another */
      for (int64_t p = 0; p < parts; p++)  /* (its keys and values then read from the memory once) */
        for (int64_t b = 0; b < blocks; b++) {
          if (!work) continue;
          block kb;
          block_of(g, b, size, queries, group, heads, d, q, ldq, mask, ldm, out, &kb);
          float *qf = work + PART_WORK(size, span), *res = results + ((g * blocks + b) * parts + p) * stride;
          int64_t from = p == 0 ? 0 : (first / SPLIT + p) * SPLIT - first;
          int64_t to = p == parts - 1 ? length : (first / SPLIT + p + 1) * SPLIT - first;
          const char *kg = (const char *)k + (size_t)(g * capacity) * row;
          const char *vg = (const char *)v + (size_t)(g * capacity) * row;
          if (amx) {
            const uint16_t *wg = wide ? wide + g * w32 * d : 0; /* its values' B tiles, if made */
            const float *ug = wide ? units + g * w32 : 0;
            q4_part_amx(amx, kv8, kb.n, d, kb.q, scale, kg, vg, wg, ug, from, to, open, kb.mask, work, qf, res,
                        res + size, res + 2 * size);
            continue;
          }
          for (int64_t m = 0; m < kb.n; m++) {
            _Pragma("omp simd") for (int64_t i = 0; i < d; i++) qf[m * d + i] = bf(kb.q[m][i]) * scale;
          }
          void (*part)(ATTEND_ARGS) = isa == 2 ? (kv8 ? attend512_8 : attend512) : (kv8 ? attend256_8 : attend256);
          part(kb.n, d, qf, kg, vg, from, to, open, kb.mask, work, res, res + size, res + 2 * size);
        }
    if (tiles) q4_amx_end();
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
  free(wide);
  return failed ? -1 : 0;
}

/* The first key some query does not see (length when every query sees every key): the least of
 * each row's first, found along the rows (a row's entries lie side by side), each scan stopping at
 * the least found so far. */
int64_t q4_first_hidden(const uint16_t *mask, int64_t t, int64_t length, int64_t ldm) {
  if (!mask) return length;
  int64_t first = length;
  for (int64_t r = 0; r < t; r++) {
    const uint16_t *row = mask + r * ldm;
    for (int64_t j = 0; j < first; j++)
      if ((row[j] & 0x7fff) != 0) {
        first = j;
        break;
      }
  }
  return first;
}

int q4_attention(int isa, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
                 const uint16_t *q, int64_t ldq, const void *k, const void *v, int64_t capacity,
                 const uint16_t *mask, float scale, uint16_t *out) {
  if (d > 512 || d % HEAD_STEP) return -2;
  return q4_attend(isa & (ISA_VARIANT | ISA_KV8), amx_mode(isa, d, 0), threads, t, heads, kv_heads, d, length, 0, q,
                   ldq, k, v, capacity, mask, length, q4_first_hidden(mask, t, length, length), scale, out);
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

/* A row of n bf16 values' argmax as torch's (below), NaNs aside: with AVX-512 in one pass, each lane
 * keeping its largest and where it first saw it; with AVX2 a pass for the largest, then a search. */
T512 static int64_t row_argmax512(const uint16_t *x, int64_t n, int *nan) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
    __m512 v = LOAD_BF512(x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __mmask16 up = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strictly: a lane keeps its first */
    best = _mm512_mask_mov_ps(best, up, v);
    at = _mm512_mask_mov_epi32(at, up, idx);
  }
  float top = _mm512_reduce_max_ps(best);
  int64_t first = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ), at);
  for (; i < n; i++) {
    float v = bf(x[i]);
    bad |= v != v;
    if (v > top) top = v, first = i;
  }
  *nan = bad != 0;
  return first;
}
T256 static int64_t row_argmax256(const uint16_t *x, int64_t n, int *nan) {
  float top = -INFINITY;
  int bad = 0;
  _Pragma("omp simd reduction(max : top) reduction(| : bad)") for (int64_t i = 0; i < n; i++) {
    float v = bf(x[i]);
    bad |= v != v;
    top = v > top ? v : top;
  }
  int64_t at = 0;
  while (at < n - 1 && bf(x[at]) != top) at++;
  *nan = bad;
  return at;
}

/* Each row's index of its largest value (rows of n bf16, ld apart), as torch's argmax gives it:
 * the first of equal ones, and a NaN counts as the largest (the first NaN's index then). On the
 * CPU torch widens bf16 logits to float32 first, ~0.4 ms a row of a 262k vocabulary (3.5 ms for a
 * 16-node tree's); here in vectors, the rows over the threads. isa: the variant's number. */
void q4_argmax(int isa, int threads, int64_t rows, int64_t n, const uint16_t *x, int64_t ld, int64_t *out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && rows * n >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *xr = x + r * ld;
    int nan;
    int64_t at = ((isa & ISA_VARIANT) == 2 ? row_argmax512 : row_argmax256)(xr, n, &nan);
    if (nan)
      for (at = 0; at < n - 1 && bf(xr[at]) == bf(xr[at]);) at++; /* the first NaN */
    out[r] = at;
  }
}
