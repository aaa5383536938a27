/* attend_amx.c's tile products made in AVX-512 vectors (`vdpbf16ps`, `vpdpbusd`): the same
 * attention on a CPU with AVX-512's bf16 and VNNI products and no AMX (AMD's Zen 4 and later,
 * Intel's Cooper Lake), ISA_DOT in a variant's number.
 *
 * A tile product's lane (one key and one query, or one query and one dim) is here one vector
 * lane: a chain of `vdpbf16ps` over the head's dims two at a time, in order (each adding two
 * exact bf16 products), or of `vpdpbusd` over four int8 dims at a time (exact integers). Such a
 * lane's bits do not depend on which operand is the broadcast one, so the scores of a block of
 * many queries take a key's pair broadcast against 16 queries' (a lane a query, as AMX's tile),
 * those of a few queries a query's pair against 16 keys transposed in registers (a lane a key):
 * the same bits either way, and a tree's node gets those of a one-token step. A weighted value's
 * lane sums its 32 keys' products in order, one pair at a time: the slots' discipline AMX needs
 * (values_amx) holds here too. The bits differ from AMX's in the weighted values' last places
 * (another order of sums) and equal them in the 8-bit scores (exact integers, scaled alike). The
 * 8-bit cache's weighted values are not AMX's at all: exact integer sums of int16 weights
 * (q4_dot_values8), a third fewer instructions a key than its bf16 tiles emulated, and no slots to
 * keep.
 */
#include "attend_amx.h"

#if Q4_NEW_ISAS
/* The tiles' target; AMX's own instructions are not used here (the caller checks the CPU's
 * AVX-512 BF16 and VNNI). */
#define TDOT TAMXB

/* c (16 rows × 64 floats: tile t's row r at r · 64 + 16t) += A × B for A's rows [r0, r0 + G)
 * (row r at a + r · lda bytes: 16 pairs of bf16, the keys 2p and 2p + 1 of a 32-key block) and the
 * B tiles at `pairs` (T of them, each 16 rows p × 16 dims × 2 keys), pair by pair in order. */
TDOT static inline __attribute__((always_inline)) void product_g(const int G, const int T, int r0, const void *a,
                                                                int64_t lda, const uint16_t *pairs, float *c) {
  __m512 acc[4][4];
  for (int r = 0; r < G; r++)
    for (int t = 0; t < T; t++) acc[r][t] = _mm512_loadu_ps(c + (r0 + r) * 64 + 16 * t);
  for (int p = 0; p < 16; p++) {
    __m512bh b[4];
    for (int t = 0; t < T; t++) b[t] = (__m512bh)_mm512_loadu_si512(pairs + t * 512 + p * 32);
    for (int r = 0; r < G; r++) {
      __m512bh x = (__m512bh)_mm512_set1_epi32(*(const int *)((const char *)a + (r0 + r) * lda + 4 * p));
      for (int t = 0; t < T; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], x, b[t]);
    }
  }
  for (int r = 0; r < G; r++)
    for (int t = 0; t < T; t++) _mm512_storeu_ps(c + (r0 + r) * 64 + 16 * t, acc[r][t]);
}

/* The emulated `tdpbf16ps` of attend_amx.c's weighted values: c += A × B (product_g's) for A's
 * first `rows` rows and `tiles` (2 or 4) B tiles. */
TDOT void q4_dot_product(int rows, int tiles, const void *a, int64_t lda, const uint16_t *pairs, float *c) {
  int r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4)
    tiles == 4 ? product_g(4, 4, r0, a, lda, pairs, c) : product_g(4, 2, r0, a, lda, pairs, c);
  /* the last 1-3 rows together: each B row read once for them (a one-token step's 3 queries a kv head) */
  if (rows - r0 == 3) tiles == 4 ? product_g(3, 4, r0, a, lda, pairs, c) : product_g(3, 2, r0, a, lda, pairs, c);
  if (rows - r0 == 2) tiles == 4 ? product_g(2, 4, r0, a, lda, pairs, c) : product_g(2, 2, r0, a, lda, pairs, c);
  if (rows - r0 == 1) tiles == 4 ? product_g(1, 4, r0, a, lda, pairs, c) : product_g(1, 2, r0, a, lda, pairs, c);
}

/* tile (16 keys × 16 queries, a row a key) = the bf16 dot products of 16 keys (rows d apart) with
 * the queries in qt (scores_amx's B layout: pair i of query m at qt[16i + m]), 8 keys at a time. */
TDOT void q4_dot_scores(int64_t d, const uint32_t *qt, const uint16_t *rows, float *tile) {
  for (int r0 = 0; r0 < KEYS16; r0 += 8) {
    __m512 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d / 2; i++) {
      __m512bh qp = (__m512bh)_mm512_loadu_si512(qt + 16 * i);
      for (int r = 0; r < 8; r++) {
        uint32_t k;
        memcpy(&k, rows + (r0 + r) * d + 2 * i, sizeof k);
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)k), qp);
      }
    }
    for (int r = 0; r < 8; r++) _mm512_storeu_ps(tile + 16 * (r0 + r), acc[r]);
  }
}

/* s (n rows of `padded`, from the block's first key) = the same products for n queries, a lane a
 * key (16 keys' pairs transposed in registers), times `scale`. */
TDOT void q4_dot_scores_few(int64_t n, int64_t d, const uint32_t *qt, const uint16_t *rows, float scale, float *s,
                            int64_t padded) {
  __m512 acc[AMX_QUERIES];
  for (int64_t m = 0; m < n; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t h = 0; h < d / 32; h++) { /* pairs 16h .. 16h + 15 */
    __m512 r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(rows + j * d + 32 * h);
    transpose16(r);
    for (int i = 0; i < 16; i++)
      for (int64_t m = 0; m < n; m++)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)r[i], (__m512bh)_mm512_set1_epi32((int)qt[16 * (16 * h + i) + m]));
  }
  for (int64_t m = 0; m < n; m++) _mm512_storeu_ps(s + m * padded, _mm512_mul_ps(acc[m], _mm512_set1_ps(scale)));
}

#define U8 0x80808080u /* an int8 query's bytes + 128: the unsigned operand of `vpdpbusd` */

/* The 8-bit cache's: tile (16 keys × 16 queries, int32) = the exact integer dot products of 16 keys
 * (8-bit rows `row` bytes apart, d a multiple of 64) with the int8 queries in qt (q4_scores_amx8's
 * B layout: dims 4g .. 4g + 3 of query m at qt[16g + m]): Σ (q + 128) · k − 128 · Σ k. */
TDOT void q4_dot_scores8(int64_t d, const uint32_t *qt, const int8_t *rows, int64_t row, int32_t *tile) {
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi32((int)U8);
  for (int r0 = 0; r0 < KEYS16; r0 += 8) {
    __m512i acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_si512();
    for (int64_t g = 0; g < d / 4; g++) {
      __m512i qu = _mm512_xor_si512(_mm512_loadu_si512(qt + 16 * g), flip);
      for (int r = 0; r < 8; r++) {
        uint32_t k;
        memcpy(&k, rows + (r0 + r) * row + 4 * g, sizeof k);
        acc[r] = _mm512_dpbusd_epi32(acc[r], qu, _mm512_set1_epi32((int)k));
      }
    }
    for (int r = 0; r < 8; r++) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t c = 0; c < d; c += 64)
        sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(rows + (r0 + r) * row + c));
      __m512i fix = _mm512_set1_epi32(128 * _mm512_reduce_add_epi32(sum));
      _mm512_storeu_si512(tile + 16 * (r0 + r), _mm512_sub_epi32(acc[r], fix));
    }
  }
}

/* s (n rows of `padded`) = those products for n queries, a lane a key, × the keys' scales (ks) ×
 * each query's (qs), in q4_scores_amx8's order; qu: qt's layout with each byte + 128 already
 * (U8's flip made once a part, not once for every 16 keys). */
TDOT static inline __attribute__((always_inline)) void scores8_few_g(const int G, int64_t d, const uint32_t *qu,
                                                                    const int8_t *rows, int64_t row, const float *ks,
                                                                    const float *qs, float *s, int64_t padded) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[DOT_FEW], sum = _mm512_setzero_si512();
  for (int m = 0; m < G; m++) acc[m] = _mm512_setzero_si512();
  for (int64_t h = 0; h < d / 64; h++) { /* dims 64h .. 64h + 63: 16 groups of 4 */
    __m512 r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_ps(rows + j * row + 64 * h);
    transpose16(r);
    for (int i = 0; i < 16; i++) {
      __m512i k = _mm512_castps_si512(r[i]);
      sum = _mm512_dpbusd_epi32(sum, ones, k);
      for (int m = 0; m < G; m++)
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_set1_epi32((int)qu[16 * (16 * h + i) + m]), k);
    }
  }
  const __m512i fix = _mm512_slli_epi32(sum, 7);
  const __m512 keys = _mm512_loadu_ps(ks);
  for (int m = 0; m < G; m++) {
    __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m], fix)), keys);
    _mm512_storeu_ps(s + m * padded, _mm512_mul_ps(x, _mm512_set1_ps(qs[m])));
  }
}

/* (n < DOT_FEW: unrolled for each count, the queries' sums kept in registers) */
TDOT void q4_dot_scores8_few(int64_t n, int64_t d, const uint32_t *qu, const int8_t *rows, int64_t row,
                             const float *ks, const float *qs, float *s, int64_t padded) {
  switch (n) {
#define FEW(G)                                                                                                       \
  case G:                                                                                                            \
    scores8_few_g(G, d, qu, rows, row, ks, qs, s, padded);                                                           \
    break;
    FEW(1) FEW(2) FEW(3) FEW(4) FEW(5) FEW(6) FEW(7)
#undef FEW
  }
}

#define VALUE_GROUP 4 /* the queries whose sums are made together (4 vectors each for 64 dims; with 6, GCC
                       * spilled them and the 64-row passes lost 25 %) */

/* 64 dims of two keys' 8-bit values (b NULL: zeros) → x: their int16 pairs, dim by dim, in the order
 * one unpack of 128-bit lanes gives (values8_g's `at` puts the sums back in order). */
TDOT static inline __attribute__((always_inline)) void widen_pair(const int8_t *a, const int8_t *b, __m512i x[4]) {
  __m512i ra = _mm512_loadu_si512(a), rb = b ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
  __m512i lo = _mm512_unpacklo_epi8(ra, rb), hi = _mm512_unpackhi_epi8(ra, rb);
  x[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo));
  x[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1));
  x[2] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi));
  x[3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1));
}

/* Rows [0, count) of 8-bit values (KV8_ROW apart) widened once as values8_g reads them (two keys'
 * pairs of every dim: 2d int16 a pair of keys, 64 dims at a time; a last odd key paired with zeros),
 * their scales to `units`: what a many-row pass's query blocks share (step.c), so that each
 * widens none. */
TDOT void q4_dot_pairs16(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units) {
  int64_t row = KV8_ROW(d);
  for (int64_t j = 0; j < count; j += 2)
    for (int64_t c = 0; c < d; c += 64) {
      __m512i x[4];
      widen_pair(rows + j * row + c, j + 1 < count ? rows + (j + 1) * row + c : 0, x);
      for (int i = 0; i < 4; i++) _mm512_storeu_si512(out + ((j / 2 * (d / 64) + c / 64) * 4 + i) * 32, x[i]);
    }
  for (int64_t j = 0; j < count; j++) units[j] = kv8_scale(rows + j * row, d);
}

/* sums (G rows of d int32) = Σ_j w16[m][j] · value j (keys [0, length), two at a time) for G queries. */
TDOT static inline __attribute__((always_inline)) void values8_g(const int G, int64_t d, const int8_t *v,
                                                                const int16_t *wide, int64_t length,
                                                                const uint16_t *w16, int64_t stride, int32_t *sums) {
  int64_t row = KV8_ROW(d);
  for (int64_t c = 0; c < d; c += 64) {
    __m512i acc[VALUE_GROUP][4];
    for (int m = 0; m < G; m++)
      for (int i = 0; i < 4; i++) acc[m][i] = _mm512_setzero_si512();
    for (int64_t j = 0; j < length; j += 2) {
      __m512i x[4];
      if (wide) {
        for (int i = 0; i < 4; i++) x[i] = _mm512_loadu_si512(wide + ((j / 2 * (d / 64) + c / 64) * 4 + i) * 32);
      } else { /* read as they come: the CPU's own prefetchers follow the rows (software prefetches
                * here, ahead and of the following part, made a one-token step's attention 8-16 % slower) */
        widen_pair(v + j * row + c, j + 1 < length ? v + (j + 1) * row + c : 0, x);
      }
      for (int m = 0; m < G; m++) {
        uint32_t pair;
        memcpy(&pair, w16 + m * stride + j, sizeof pair);
        __m512i wp = _mm512_set1_epi32((int)pair);
        for (int i = 0; i < 4; i++) acc[m][i] = _mm512_dpwssd_epi32(acc[m][i], x[i], wp);
      }
    }
    /* x[i]'s lanes 0-7 and 8-15 hold the dims at these offsets in the 64 */
    static const int at[4][2] = {{0, 16}, {32, 48}, {8, 24}, {40, 56}};
    for (int m = 0; m < G; m++)
      for (int i = 0; i < 4; i++) {
        _mm256_storeu_si256((__m256i *)(sums + m * d + c + at[i][0]), _mm512_castsi512_si256(acc[m][i]));
        _mm256_storeu_si256((__m256i *)(sums + m * d + c + at[i][1]), _mm512_extracti64x4_epi64(acc[m][i], 1));
      }
  }
}

/* The 8-bit cache's weighted values in exact integers (the dot kernel's, few queries or many): each
 * query's weights (e^(score - top) times the key's value scale, p[m·padded + j], as weights_amx
 * makes them with their largest, most[m]) rounded to int16 on the query's own scale (that largest
 * ↦ 32767), then Σ w · v over the part's keys two at a time (`vpdpwssd`: exact, the int8 values
 * widened to int16; a part's ≤ SPLIT keys cannot overflow: 512 · 32767 · 128 < 2³¹), times that
 * scale. An integer sum has no order, so a query's bits depend on its own weights and values only:
 * not on the queries it is grouped with, nor on the slots its keys sit in (a tree's node gets those
 * of a one-token step). acc: n × d;
 * w16: n rows of `stride` int16 (stride ≥ length rounded up to even); wide: the values widened
 * already (q4_dot_pairs16's, from the part's first key; with `tiles`, q4_quads8's, the sums then
 * made on the configured tiles: q4_tile_values8), or NULL. */
TDOT void q4_dot_values8(int tiles, int64_t n, int64_t d, const int8_t *v, const int16_t *wide, int64_t length,
                         const float *p, int64_t padded, const float *most, uint16_t *w16, int64_t stride, float *acc) {
  float unit[AMX_QUERIES];
  for (int64_t m = 0; m < n; m++) { /* the weights in int16 */
    const float *pm = p + m * padded;
    int16_t *wm = (int16_t *)w16 + m * stride;
    float top = most[m];
    unit[m] = top / 32767.0f;
    __m512 up = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    for (int64_t j = 0; j < padded; j += 16) { /* to the nearest integer, ties to even */
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(pm + j), up);
      _mm256_storeu_si256((__m256i *)(wm + j), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(x)));
    }
    for (int64_t j = padded; j < stride; j++) wm[j] = 0;
  }
  int32_t *sums = (int32_t *)acc; /* made in place, then scaled */
  if (tiles && wide) /* on the tiles: the same integers */
    q4_tile_values8(n, d, (const int8_t *)wide, length, w16, stride, sums);
  else
    for (int64_t m = 0; m < n; m += VALUE_GROUP) {
      int64_t g = n - m < VALUE_GROUP ? n - m : VALUE_GROUP;
      const uint16_t *wg = w16 + m * stride;
      int32_t *sg = sums + m * d;
      if (g == 4) values8_g(4, d, v, wide, length, wg, stride, sg);
      else if (g == 3) values8_g(3, d, v, wide, length, wg, stride, sg);
      else if (g == 2) values8_g(2, d, v, wide, length, wg, stride, sg);
      else values8_g(1, d, v, wide, length, wg, stride, sg);
    }
  for (int64_t m = 0; m < n; m++)
    for (int64_t i = 0; i < d; i += 16) {
      __m512 x = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + m * d + i));
      _mm512_storeu_ps(acc + m * d + i, _mm512_mul_ps(x, _mm512_set1_ps(unit[m])));
    }
}
#else
void q4_dot_pairs16(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units) {
  (void)rows, (void)d, (void)count, (void)out, (void)units;
}
#endif
