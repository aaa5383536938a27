/* Attention on AMX, Intel's tile matrix unit (Sapphire Rapids and later).
 *
 * step.c's vector kernel spends a many-query pass (a prompt's prefill, a tree at a long context)
 * on fused adds: per key and query, four for the score (and a reduction of 16 lanes) and four for
 * the weighted value. Here one `tdpbf16ps` makes 16 keys' scores for 16 queries: tile A is 16
 * keys as they lie in the cache (32 bf16 of each a tile, read with the cache's row stride), tile
 * B the queries' matching halves side by side (two bf16 of each query a 4-byte column), so the
 * product is the scores transposed (a row a key, a lane a query), gathered back to a row a query
 * and scaled. The softmax is attend.c's (WEIGHTED), or with the values on AMX the same bits in one
 * pass that also rounds the weights to bf16 (weights_amx). The weighted values take those as tile A
 * (a row a query, 32 keys) and the values as tile B (two keys side by side).
 *
 * A score's bits depend on its query's and its key's values only (the tile unit's sum over the
 * head is the same for every pair). A weighted value's sum over 32 keys is made in the tile
 * unit's own order, so each key must sit in the slot a one-token step at the query's position has
 * it in (values_amx), and a tree's node then gets the bits of that step. A layer with a sliding
 * window takes the scores alone on AMX (its masks hide early keys: slots and positions part). The
 * bits differ from the vector kernel's in their last places (another order of sums, the scale
 * applied after the scores, the weights in bf16), so a model runs one or the other for its whole
 * session (its measured choice: core/measure/cpu_attention.py). The 8-bit cache's own parts are in
 * attend_amx8.c. With AMX_DOT in `amx` (ISA_DOT) every tile product is made in AVX-512 vectors
 * instead (attend_dot.c), on a CPU without AMX, and the 8-bit cache's weighted values in exact
 * integers (q4_dot_values8).
 */
#include "attend_amx.h"

#include <float.h>

#if !Q4_NEW_ISAS
int q4_amx_attention(void) { return -1; }
void q4_amx_begin(void) {}
void q4_amx_end(void) {}
void q4_part_amx(int amx, int kv8, int64_t n, int64_t d, const uint16_t *const *q, float scale, const void *k,
                 const void *v, const uint16_t *wide, const float *wide_units, int64_t from, int64_t to,
                 int64_t open, const uint16_t *const *mask, float *scores, float *scratch, float *top, float *total,
                 float *acc) {
  (void)amx, (void)kv8, (void)wide, (void)wide_units, (void)n, (void)d, (void)q, (void)scale, (void)k, (void)v;
  (void)from, (void)to, (void)open, (void)mask;
  (void)scores, (void)scratch, (void)top, (void)total, (void)acc;
}
#else

/* 0 where this build has the AMX-BF16 kernel (the CPU's and Linux's say: stepops.py). */
int q4_amx_attention(void) { return 0; }

/* A thread's tiles for q4_part_amx (before its first part; q4_amx_end after its last): eight of
 * 16 rows × 64 bytes (the scores: 0 sums, 1 keys, 2 queries; the values: 0-3 sums, 4 weights,
 * 5-7 values, in turn: a product need not wait for the one before to free its tile). */
TAMXB void q4_amx_begin(void) {
  /* static: GCC took the stores to a local one for dead (the instruction's read unseen) */
  static const tile_config cfg = {.palette = 1,
                                  .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                  .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
  _tile_loadconfig(&cfg);
}

TAMXB void q4_amx_end(void) { _tile_release(); }

/* s (n rows of `padded`): the scores of queries q[0, n) (bf16 rows) against the keys k[0, length)
 * (d apart; the values v beside them, or NULL, prefetched to L2 as the keys go by), times
 * `scale`; rows' entries from `length` on are 0 (WEIGHTED hides them). Scratch: tile (256
 * floats), qt (8·d: the queries as tile B, d / 32 tiles), tail (16·d bf16: the last keys,
 * zero-padded, so that no tile reads past the cache's `length`). */
TAMXB static void scores_amx(int dot, int64_t n, int64_t d, const uint16_t *const *q, float scale, const uint16_t *k,
                             const uint16_t *v, int64_t length, int64_t padded, float *tile, uint32_t *qt,
                             uint16_t *tail, float *s) {
  int64_t chunks = d / 32;
  memset(qt, 0, sizeof(uint32_t) * (size_t)(8 * d));
  for (int64_t m = 0; m < n; m++) /* B row p of chunk c: dims 32c + 2p, 2p + 1 of each query (pair 16c + p) */
    for (int64_t i = 0; i < d / 2; i++) memcpy(qt + i * 16 + m, q[m] + 2 * i, sizeof(uint32_t));
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < padded; j0 += KEYS16) {
    const uint16_t *rows = k + j0 * d;
    if (j0 + KEYS16 > length) {
      memset(tail, 0, sizeof(uint16_t) * (size_t)(KEYS16 * d));
      memcpy(tail, rows, sizeof(uint16_t) * (size_t)((length - j0) * d));
      rows = tail;
    }
    for (int64_t b = 0; j0 + AHEAD + KEYS16 <= length && b < KEYS16 * d * 2; b += 64) { /* keys and values ahead */
      _mm_prefetch((const char *)(k + (j0 + AHEAD) * d) + b, _MM_HINT_T0);
      if (v) _mm_prefetch((const char *)(v + (j0 + AHEAD) * d) + b, _MM_HINT_T1);
    }
    if (dot && n < DOT_FEW) { /* a lane a key (attend_dot.c) */
      q4_dot_scores_few(n, d, qt, rows, scale, s + j0, padded);
      continue;
    }
    if (dot) {
      q4_dot_scores(d, qt, rows, tile);
    } else {
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(1, rows + 32 * c, d * (int64_t)sizeof(uint16_t));
        _tile_loadd(2, qt + c * 256, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, tile, 64); /* a row a key, a lane a query */
    }
    if (n > 4) { /* a row a query: the tile transposed, or for a few queries their columns gathered */
      __m512 r[16];
      for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(tile + 16 * i);
      transpose16(r);
      for (int64_t m = 0; m < n; m++) _mm512_storeu_ps(s + m * padded + j0, _mm512_mul_ps(r[m], sc));
    } else {
      for (int64_t m = 0; m < n; m++) {
        __m512 x = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32((int)m)), tile, 4);
        _mm512_storeu_ps(s + m * padded + j0, _mm512_mul_ps(x, sc));
      }
    }
  }
}

/* B tiles (`tiles` of 16 dims from dim c; 2 or 4) of 32 keys' values: row p holds keys 2p and 2p
 * + 1 side by side, dim by dim (tile A's weights pair them so), in the order one unpack of a
 * 128-bit lane gives: of 32 dims, tile 2h has dims 0-3, 8-11, 16-19, 24-27 and tile 2h + 1 the
 * others (`in_order` puts the sums back). rows[j]: key j's values, or NULL (zeros). out: tiles ×
 * 16 × 32 bf16. */
TAMXB static void pairs_of(const uint16_t *const *rows, int64_t c, int tiles, uint16_t *out) {
  for (int p = 0; p < 16; p++)
    for (int h = 0; h < tiles; h += 2) { /* 32 dims: tiles h and h + 1 */
      const uint16_t *a = rows[2 * p], *b = rows[2 * p + 1];
      __m512i x = a ? _mm512_loadu_si512(a + c + 16 * h) : _mm512_setzero_si512();
      __m512i y = b ? _mm512_loadu_si512(b + c + 16 * h) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + (h * 16 + p) * 32, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(out + ((h + 1) * 16 + p) * 32, _mm512_unpackhi_epi16(x, y));
    }
}

/* The B tiles of keys[0, 32) (-1: none; relative to v) for dims [c, c + 16·tiles): pairs_of's of
 * bf16 rows, or pairs8's of 8-bit ones (dims in order), made into `out`. */
TAMXB static const uint16_t *b_tiles(const char *v, int kv8, int64_t d, const int64_t *keys, int64_t c, int tiles,
                                     uint16_t *out) {
  if (kv8) {
    const int8_t *rows[32];
    for (int j = 0; j < 32; j++) rows[j] = keys[j] >= 0 ? (const int8_t *)v + keys[j] * KV8_ROW(d) : 0;
    q4_pairs8(rows, c, tiles, out);
  } else {
    const uint16_t *rows[32];
    for (int j = 0; j < 32; j++) rows[j] = keys[j] >= 0 ? (const uint16_t *)v + keys[j] * d : 0;
    pairs_of(rows, c, tiles, out);
  }
  return out;
}

/* A query's sums (the tiles' columns in pairs_of's order, or with kv8 pairs8's: in order) → dims in
 * order. */
static void in_order(const float *sums, int tiles, int kv8, float *out) {
  if (kv8) {
    memcpy(out, sums, sizeof(float) * 16 * (size_t)tiles);
    return;
  }
  for (int t = 0; t < tiles; t++)
    for (int n = 0; n < 16; n++) out[16 * (t & ~1) + 8 * (n / 4) + 4 * (t & 1) + n % 4] = sums[16 * t + n];
}

/* A pass's C tiles 0-3: the tile unit's, or with `dot` (attend_dot.c's products) 16 rows of 64
 * floats at c (tile t's row r at r · 64 + 16t), of which the first `rows` count. */
typedef struct {
  int dot, rows;
  float *c;
} sums;

TAMXB static inline void zero(const sums *u) {
  if (u->dot) {
    memset(u->c, 0, sizeof(float) * 64 * (size_t)u->rows);
    return;
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

/* C tiles 0..tiles-1 += tile A (at a, row stride lda bytes) × the B tiles at `pairs`. */
TAMXB static inline void product(const sums *u, int tiles, const void *a, int64_t lda, const uint16_t *pairs) {
  if (u->dot) {
    q4_dot_product(u->rows, tiles, a, lda, pairs, u->c);
    return;
  }
  _tile_loadd(4, a, lda);
  _tile_loadd(5, pairs, 64);
  _tile_loadd(6, pairs + 512, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(1, 4, 6);
  if (tiles == 4) {
    _tile_loadd(7, pairs + 1024, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, pairs + 1536, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

/* c (rows ldc bytes apart) ← the C tiles (`to`), or the C tiles ← c. */
TAMXB static inline void move(const sums *u, int to, int tiles, float *c, int64_t ldc) {
  if (u->dot) {
    for (int r = 0; r < u->rows; r++)
      if (to)
        memcpy(c + r * ldc / 4, u->c + r * 64, sizeof(float) * 16 * (size_t)tiles);
      else
        memcpy(u->c + r * 64, c + r * ldc / 4, sizeof(float) * 16 * (size_t)tiles);
    return;
  }
  if (to) {
    _tile_stored(0, c, ldc);
    _tile_stored(1, c + 16, ldc);
    if (tiles == 4) {
      _tile_stored(2, c + 32, ldc);
      _tile_stored(3, c + 48, ldc);
    }
  } else {
    _tile_loadd(0, c, ldc);
    _tile_loadd(1, c + 16, ldc);
    if (tiles == 4) {
      _tile_loadd(2, c + 32, ldc);
      _tile_loadd(3, c + 48, ldc);
    }
  }
}

/* Whether query m's keys from `open` on, among the part's [0, length), are a run from `open` (its
 * weights then lie in the slots a one-token step has them in). */
static int in_place(const uint16_t *mask, int64_t from, int64_t open, int64_t length) {
  if (!mask) return 1;
  int64_t j = open;
  while (j < length && (mask[from + j] & 0x7fff) == 0) j++;
  while (j < length && (mask[from + j] & 0x7fff) != 0) j++;
  return j == length;
}

/* values_amx's scratch: the weights in bf16 (pb: a row a query, p32 keys), the B tiles made for a
 * product (pairs), a query's own row of weights (row), the C tiles' sums (cs), the keys' value
 * scales (units: 8-bit values; 1 past `length`), then attend_dot.c's C rows (dots). */
typedef struct {
  int64_t p32, shared;
  uint16_t *pb, *pairs, *row;
  float *cs, *units, *dots;
  int own[AMX_QUERIES]; /* whether query m has products of its own from `shared` on (values_amx) */
  int ints;             /* the weighted values in integers (q4_dot_values8): no bf16 weights to round */
  float most[AMX_QUERIES]; /* with ints: each query's largest weight times its value's scale */
} weights;

TAMXB static void weights_at(float *scratch, int64_t length, int64_t seen, weights *w) {
  w->p32 = (length + 31) / 32 * 32, w->shared = seen / 32 * 32, w->ints = 0;
  w->pb = (uint16_t *)scratch, w->pairs = w->pb + 16 * w->p32, w->row = w->pairs + 4 * 512;
  w->cs = (float *)(w->row + 16 * 32), w->units = w->cs + 17 * 64, w->dots = w->units + w->p32;
}

/* A weight as weights_amx rounds it for the tiles (vcvtneps2bf16): to the nearest bf16, ties to
 * even, a denormal to 0. */
static inline uint16_t tile_weight(float w) { return fabsf(w) < FLT_MIN ? 0 : float_to_bf16(w); }

/* WEIGHTED's softmax (attend.c: the same top, weights and sums, bit for bit) fused with the
 * weights' rounding to bf16 for the tiles: each query's masked scores hidden, its top, then in
 * one pass over its row e^(score - top) (an exact 0 where hidden), their sum in WEIGHTED's order,
 * and the weight times its key's value scale (8-bit values) in bf16 to pb, up to `shared` for a
 * query with products of its own (values_amx), 0 past that. With `ints` (q4_dot_values8's integer
 * values) the row keeps each weight times its value's scale instead, and `most` their largest. */
TAMXB static void weights_amx(int64_t n, int64_t d, const char *v, int kv8, const float *wide_units, int64_t from,
                              int64_t to, int64_t seen, const uint16_t *const *mask, float *scores, float *top,
                              float *total, weights *w) {
  int64_t length = to - from, padded = PADDED(length), bytes = kv8 ? KV8_ROW(d) : 2 * d;
  if (kv8) { /* the values' scales (made already, perhaps in place: the scores' pass reads them), 1 past `length` */
    if (wide_units && wide_units != w->units) memcpy(w->units, wide_units, sizeof(float) * (size_t)length);
    for (int64_t j = 0; !wide_units && j < length; j++) w->units[j] = kv8_scale((const int8_t *)v + j * bytes, d);
    for (int64_t j = length; j < w->p32; j++) w->units[j] = 1.0f; /* (their weights are 0) */
  }
  const __m512 hidden = _mm512_set1_ps(-INFINITY);
  for (int64_t m = 0; m < n; m++) {
    float *sm = scores + m * padded;
    uint16_t *pb = w->pb + m * w->p32;
    w->own[m] = !in_place(mask[m], from, seen, length);
    if (mask[m])
      for (int64_t j = seen; j < length; j++)
        if ((mask[m][from + j] & 0x7fff) != 0) sm[j] = -INFINITY;
    for (int64_t j = length; j < padded; j++) sm[j] = -INFINITY;
    float t = top[m] = top512(padded, sm);
    if (!w->ints) memset(pb, 0, sizeof(uint16_t) * (size_t)w->p32);
    w->most[m] = 0.0f;
    if (t == -INFINITY) { /* it sees no key of this part */
      memset(sm, 0, sizeof(float) * (size_t)padded);
      total[m] = 0.0f;
      continue;
    }
    __m512 tv = _mm512_set1_ps(t), most = _mm512_setzero_ps();
    __m512i sum = _mm512_setzero_si512(); /* in fixed point, as sums512 (common.h) */
    int64_t rounded = w->ints ? 0 : w->own[m] ? w->shared : padded; /* own: its products from `shared` on */
    for (int64_t j = 0; j < padded; j += 16) {
      __m512 x = _mm512_loadu_ps(sm + j);
      __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, hidden, _CMP_NEQ_OQ), exp512(_mm512_sub_ps(x, tv)));
      if (w->ints) { /* the weight times its value's scale, as q4_dot_values8 takes it, and the largest */
        __m512 scaled = _mm512_mul_ps(e, _mm512_loadu_ps(w->units + j));
        _mm512_storeu_ps(sm + j, scaled);
        most = _mm512_max_ps(most, scaled);
      } else {
        _mm512_storeu_ps(sm + j, e);
      }
      sum = _mm512_add_epi32(sum, fixed512(e));
      if (j < rounded) /* to nearest even, a denormal to 0 (the instruction's; tile_weight's alike) */
        _mm256_storeu_si256((__m256i *)(pb + j),
                            (__m256i)_mm512_cvtneps_pbh(kv8 ? _mm512_mul_ps(e, _mm512_loadu_ps(w->units + j)) : e));
    }
    total[m] = (float)_mm512_reduce_add_epi32(sum) / SUM_UNIT;
    w->most[m] = _mm512_reduce_max_ps(most);
  }
}

/* acc (n × d) = each query's weighted values (weights p: n rows of `padded`; in bf16 in w's pb),
 * 32 keys a product. The tile unit sums a product's 32 terms in an order of its own, so a key's
 * sum must see it in the slot a one-token step at the query's position has it in: keys before
 * `open` (seen by every query) are in place, and so are a query's keys from there on where they
 * are a run from `open` (a prompt's causal rows, a one-token step); the products of those run
 * for all queries together (a key not seen weighs an exact 0, a slot past `length` is 0). Any
 * other query (a tree's node off its first path) has, from the last multiple of 32 before `open`,
 * products of its own: its keys from `open` on gathered in order to the slots from `open`, where
 * a layer without a sliding window has them (positions follow slots). On a Sapphire Rapids the
 * sum came out the same whatever the slots (the tests pass with no query's own products), as if
 * each product were aligned to the largest and truncated, but Intel does not say so: the slots
 * are kept. */
TAMXB static void values_amx(int dot, int64_t n, int64_t d, const char *v, int kv8, const uint16_t *wide,
                             int64_t length, int64_t open, const uint16_t *const *mask, int64_t from, const float *p,
                             int64_t padded, float *acc, const weights *w) {
  int64_t p32 = w->p32, shared = w->shared, bytes = kv8 ? KV8_ROW(d) : 2 * d;
  uint16_t *pb = w->pb, *pairs = w->pairs, *row = w->row;
  float *cs = w->cs, *units = w->units;
  sums all = {dot, (int)n, w->dots}, one = {dot, 1, w->dots}; /* every query's products; one query's */
  const int *own = w->own; /* rows of pb from n on: any values (their sums are not read) */
  memset(row, 0, sizeof(uint16_t) * 16 * 32);
  int64_t keys[32];
  for (int64_t c = 0; c < d; c += 64) {
    int tiles = d - c >= 64 ? 4 : 2;
    zero(&all);
    for (int64_t kb = 0; kb < p32; kb += 32) {
      for (int64_t b = 0; c == 0 && !wide && kb + 64 <= length && b < 32 * bytes; b += 64) /* the values ahead */
        _mm_prefetch(v + (kb + 32) * bytes + b, _MM_HINT_T0);
      for (int j = 0; j < 32; j++) keys[j] = kb + j < length ? kb + j : -1;
      const uint16_t *b = wide ? wide + kb * d + c * 32 : b_tiles(v, kv8, d, keys, c, tiles, pairs);
      product(&all, tiles, pb + kb, p32 * (int64_t)sizeof(uint16_t), b);
    }
    move(&all, 1, tiles, cs, 256);
    for (int64_t m = 0; m < n; m++) {
      if (own[m]) { /* its sums so far (row m) go on in row 0 */
        memcpy(cs + 16 * 64, cs + m * 64, sizeof(float) * 64);
        move(&one, 0, tiles, cs + 16 * 64, 256);
        int64_t next = open; /* its next key from `open` on */
        for (int64_t kb = shared; kb < p32 && next < length; kb += 32) {
          for (int j = 0; j < 32; j++) {
            int64_t key = kb + j;
            if (key >= open) {
              while (next < length && (mask[m][from + next] & 0x7fff) != 0) next++;
              key = next < length ? next++ : -1;
            }
            keys[j] = key;
            float weight = key < 0 ? 0.0f : kv8 ? p[m * padded + key] * units[key] : p[m * padded + key];
            row[j] = key >= 0 ? tile_weight(weight) : 0; /* as the shared products' */
          }
          product(&one, tiles, row, 64, b_tiles(v, kv8, d, keys, c, tiles, pairs));
        }
        move(&one, 1, tiles, cs + 16 * 64, 256);
        in_order(cs + 16 * 64, tiles, kv8, acc + m * d + c);
      } else {
        in_order(cs + m * 64, tiles, kv8, acc + m * d + c);
      }
    }
  }
}

/* One part's attention for up to AMX_QUERIES queries (step.c's ATTEND: the part's top, sum of
 * weights and weighted values), its scores on AMX and, where amx is 2, its weighted values (plus
 * AMX_DOT: the tiles' products in vectors, attend_dot.c); q: the
 * queries' bf16 rows; k, v: bf16 rows of d, or with kv8 8-bit ones (KV8_ROW; d a multiple of 64), the
 * values then perhaps widened already (`wide`, `wide_units`: q4_widen_values' rows, NULL: none);
 * d a multiple of 32; scores: n rows of the part's keys padded to 16; scratch: AMX_WORK(padded, d)
 * floats. */
TAMXB void q4_part_amx(int amx, int kv8, int64_t n, int64_t d, const uint16_t *const *q, float scale, const void *k,
                       const void *v, const uint16_t *wide, const float *wide_units, int64_t from, int64_t to,
                       int64_t open, const uint16_t *const *mask, float *scores, float *scratch, float *top,
                       float *total, float *acc) {
  int dot = amx & AMX_DOT; /* the products in vectors (attend_dot.c) */
  int onboard = dot && amx & AMX_TILES;         /* but an 8-bit cache's integers on the tiles: the same ones */
  int tiled = onboard && n >= DOT_FEW;          /* (the scores of a block of many queries) */
  amx = AMX_MODE(amx);
  int64_t length = to - from, padded = (length + KEYS16 - 1) / KEYS16 * KEYS16, bytes = kv8 ? KV8_ROW(d) : 2 * d;
  uint32_t *qt = (uint32_t *)(scratch + 256);
  const char *kp = (const char *)k + from * bytes, *vp = (const char *)v + from * bytes;
  int64_t seen = open - from < 0 ? 0 : open - from > length ? length : open - from; /* keys all queries see */
  weights w;
  if (amx == 2) weights_at(scratch + 256 + 24 * d + 64, length, seen, &w);
  const float *units = wide ? wide_units + from : 0; /* the values' scales, where made already */
  if (kv8) {
    const int8_t *ahead = wide ? 0 : (const int8_t *)vp; /* values to prefetch with the keys (not yet widened) */
    /* the dot kernel's integer values: their scales read with the keys' (weights_amx takes them as made) */
    float *made = dot && amx == 2 && ahead ? w.units : 0;
    for (int64_t j = 0; ahead && amx == 2 && !made && j < length; j++) /* the line of each value's scale, read */
      _mm_prefetch((const char *)(ahead + j * KV8_ROW(d) + d), _MM_HINT_T1); /* first by weights_amx (1-8 % less) */
    q4_scores_amx8(dot && !tiled, n, d, q, scale, (const int8_t *)kp, ahead, made, length, padded, scratch, (int8_t *)qt,
                   (int8_t *)(qt + 8 * d), (float *)(qt + 24 * d), scores);
    if (made) units = made;
    if (amx != 2) weighted512_8(n, d, v, from, to, open, mask, scores, top, total, acc);
  } else {
    scores_amx(dot, n, d, q, scale, (const uint16_t *)kp, (const uint16_t *)vp, length, padded, scratch, qt,
               (uint16_t *)(qt + 8 * d), scores);
    if (amx != 2) weighted512(n, d, v, from, to, open, mask, scores, top, total, acc);
  }
  if (amx != 2) return;
  w.ints = dot && kv8; /* the weighted values in exact integers (attend_dot.c): no slots to keep */
  weights_amx(n, d, vp, kv8, units, from, to, seen, mask, scores, top, total, &w);
  if (w.ints) {
    const void *at = !wide ? 0 : onboard ? (const void *)((const int8_t *)wide + from * d) : wide + from * d;
    q4_dot_values8(onboard, n, d, (const int8_t *)vp, at, length, scores, padded, w.most, w.pb, w.p32, acc);
  } else {
    values_amx(dot, n, d, vp, kv8, wide ? wide + from * d : 0, length, seen, mask, from, scores, padded, acc, &w);
  }
}
#endif
