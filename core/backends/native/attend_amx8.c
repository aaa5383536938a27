/* Attention on AMX over 8-bit keys and values (common.h's KV8_ROW): their scores in exact integer
 * products, their values as bf16 B tiles (attend_amx.c runs the rest).
 */
#include "attend_amx.h"

#if !Q4_NEW_ISAS
void q4_pair_values(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units) {
  (void)rows, (void)d, (void)count, (void)out, (void)units;
}
void q4_quads8(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units) {
  (void)rows, (void)d, (void)count, (void)out, (void)units;
}
#else

/* Block j0's 16 keys: where they lie in the cache, or the last ones copied to `tail` with zeros
 * after them (no tile reads past the cache's `length`). */
static inline const int8_t *block_rows(const int8_t *k, int64_t j0, int64_t length, int64_t row, int8_t *tail) {
  const int8_t *rows = k + j0 * row;
  if (j0 + KEYS16 <= length) return rows;
  memset(tail, 0, (size_t)(KEYS16 * row));
  memcpy(tail, rows, (size_t)((length - j0) * row));
  return tail;
}

/* The queries' chunk c (tile B) into the tile that keeps it: 2, then 5-7. */
#define LOAD_QUERIES(c, at)                                                                                          \
  do {                                                                                                               \
    if ((c) == 0) _tile_loadd(2, at, 64);                                                                            \
    if ((c) == 1) _tile_loadd(5, at, 64);                                                                            \
    if ((c) == 2) _tile_loadd(6, at, 64);                                                                            \
    if ((c) == 3) _tile_loadd(7, at, 64);                                                                            \
  } while (0)
/* Tile C = the products of 16 keys' rows (through tile K, chunk by chunk) with the kept queries. */
#define ISSUE(C, K, rows, chunks, row)                                                                               \
  do {                                                                                                               \
    _tile_zero(C);                                                                                                   \
    _tile_loadd(K, rows, row);                                                                                       \
    _tile_dpbssd(C, K, 2);                                                                                           \
    if ((chunks) > 1) {                                                                                              \
      _tile_loadd(K, (rows) + 64, row);                                                                              \
      _tile_dpbssd(C, K, 5);                                                                                         \
    }                                                                                                                \
    if ((chunks) > 2) {                                                                                              \
      _tile_loadd(K, (rows) + 128, row);                                                                             \
      _tile_dpbssd(C, K, 6);                                                                                         \
    }                                                                                                                \
    if ((chunks) > 3) {                                                                                              \
      _tile_loadd(K, (rows) + 192, row);                                                                             \
      _tile_dpbssd(C, K, 7);                                                                                         \
    }                                                                                                                \
  } while (0)

/* The 8-bit cache's scores (KV8_ROW rows, d a multiple of 64): each query rounded to int8 on its
 * own scale (its largest magnitude / 127), so one `tdpbssd` makes 16 keys' exact integer dot
 * products with 16 queries (tile A: 16 keys' int8 rows as they lie in the cache, 64 dims; tile B:
 * the queries' dims in fours side by side); a score is then that integer × the key's scale × the
 * query's scale × `scale`, in that order. Scratch as scores_amx's, the queries' scales in qs; v as
 * scores_amx's; units (not NULL, with v): the values' scales, read as their keys' are. */
TAMXB void q4_scores_amx8(int dot, int64_t n, int64_t d, const uint16_t *const *q, float scale, const int8_t *k,
                              const int8_t *v, float *units, int64_t length, int64_t padded, float *tile, int8_t *qt,
                              int8_t *tail, float *qs, float *s) {
  int64_t chunks = d / 64, row = KV8_ROW(d);
  memset(qt, 0, (size_t)(1024 * chunks));
  for (int64_t m = 0; m < n; m++) { /* B row p of chunk c: dims 64c + 4p .. 4p + 3 of each query (4 bytes a query) */
    __m512 most = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) most = _mm512_max_ps(most, _mm512_abs_ps(LOAD_BF512(q[m] + i)));
    float top = _mm512_reduce_max_ps(most), unit = top / 127.0f;
    __m512 u = _mm512_set1_ps(top > 0.0f ? unit : 1.0f); /* top 0: every dim 0 */
    for (int64_t i = 0; i < d; i += 16) { /* rounded to the nearest integer, ties to even */
      int8_t x[16];
      _mm_storeu_si128((__m128i *)x, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(LOAD_BF512(q[m] + i), u))));
      for (int64_t f = i; f < i + 16; f += 4) memcpy(qt + f / 64 * 1024 + f % 64 / 4 * 64 + m * 4, x + f - i, 4);
    }
    qs[m] = unit * scale;
  }
  if (dot && n < DOT_FEW) /* the few queries' bytes + 128 (q4_dot_scores8_few's unsigned operand) */
    for (int64_t b = 0; b < 1024 * chunks; b += 64)
      _mm512_storeu_si512(qt + b, _mm512_xor_si512(_mm512_loadu_si512(qt + b), _mm512_set1_epi8((char)0x80)));
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  /* on the tiles with up to 4 chunks: the queries stay in tiles 2, 5-7 and the blocks' sums
   * alternate between tiles 0 and 3 (their keys 1 and 4), a block's products issued before the one
   * before is read back: the tile unit works while the vectors scale the block before */
  int tiled = !dot && chunks <= 4;
  if (tiled) {
    for (int64_t c = 0; c < chunks; c++) LOAD_QUERIES(c, qt + c * 1024);
    if (padded) ISSUE(0, 1, block_rows(k, 0, length, row, tail), chunks, row);
  }
  for (int64_t j0 = 0; j0 < padded; j0 += KEYS16) {
    const int8_t *rows = block_rows(k, j0, length, row, tail);
    for (int64_t b = 0; j0 + AHEAD + KEYS16 <= length && b < KEYS16 * row; b += 64) { /* the keys and values ahead */
      _mm_prefetch((const char *)(k + (j0 + AHEAD) * row) + b, _MM_HINT_T0);
      if (v) _mm_prefetch((const char *)(v + (j0 + AHEAD) * row) + b, _MM_HINT_T1);
    }
    float ks[KEYS16];
    for (int i = 0; i < KEYS16; i++) ks[i] = kv8_scale(rows + i * row, d);
    for (int64_t j = j0; units && j < j0 + KEYS16 && j < length; j++) units[j] = kv8_scale(v + j * row, d);
    if (dot && n < DOT_FEW) { /* a lane a key (attend_dot.c) */
      q4_dot_scores8_few(n, d, (const uint32_t *)qt, rows, row, ks, qs, s + j0, padded);
      continue;
    }
    int odd = (int)(j0 / KEYS16 % 2);
    if (tiled && j0 + KEYS16 < padded) { /* the next block's products, on the other tiles */
      const int8_t *next = block_rows(k, j0 + KEYS16, length, row, tail); /* the last block's: as it reads again */
      if (odd)
        ISSUE(0, 1, next, chunks, row);
      else
        ISSUE(3, 4, next, chunks, row);
    }
    if (dot) {
      q4_dot_scores8(d, (const uint32_t *)qt, rows, row, (int32_t *)tile);
    } else if (tiled) {
      if (odd)
        _tile_stored(3, tile, 64);
      else
        _tile_stored(0, tile, 64); /* a row a key, a lane a query: integers */
    } else {
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(1, rows + 64 * c, row);
        _tile_loadd(2, qt + c * 1024, 64);
        _tile_dpbssd(0, 1, 2);
      }
      _tile_stored(0, tile, 64);
    }
    const __m512 keys = _mm512_loadu_ps(ks);
    if (n > 4) {
      __m512 r[16];
      for (int i = 0; i < 16; i++) r[i] = _mm512_cvtepi32_ps(_mm512_loadu_si512(tile + 16 * i));
      transpose16(r);
      for (int64_t m = 0; m < n; m++)
        _mm512_storeu_ps(s + m * padded + j0, _mm512_mul_ps(_mm512_mul_ps(r[m], keys), _mm512_set1_ps(qs[m])));
    } else {
      for (int64_t m = 0; m < n; m++) {
        __m512i x = _mm512_i32gather_epi32(_mm512_add_epi32(column, _mm512_set1_epi32((int)m)), tile, 4);
        __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(x), keys);
        _mm512_storeu_ps(s + m * padded + j0, _mm512_mul_ps(y, _mm512_set1_ps(qs[m])));
      }
    }
  }
}

/* B tiles (`tiles` of 16 dims from dim c) of 32 keys' 8-bit values widened to bf16 (exact: bf16
 * holds every int8; a row's scale is left to the weights): row p holds keys 2p and 2p + 1 side by
 * side, dim by dim, the dims in order. rows[j]: key j's 8-bit row, or NULL (zeros). out: tiles ×
 * 16 × 32 bf16. */
TAMXB void q4_pairs8(const int8_t *const *rows, int64_t c, int tiles, uint16_t *out) {
  static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i mix = _mm512_loadu_si512(order); /* x's dim i, then y's, dim by dim */
  for (int p = 0; p < 16; p++) {
    const int8_t *a = rows[2 * p], *b = rows[2 * p + 1];
    for (int t = 0; t < tiles; t++) {
      __m512 x = a ? LOAD_I8512(a + c + 16 * t) : _mm512_setzero_ps();
      __m512 y = b ? LOAD_I8512(b + c + 16 * t) : _mm512_setzero_ps();
      __m512i both = (__m512i)_mm512_cvtne2ps_pbh(y, x); /* x's 16 then y's */
      _mm512_storeu_si512(out + (t * 16 + p) * 32, _mm512_permutexvar_epi16(mix, both));
    }
  }
}

/* Rows [0, count) of 8-bit values (KV8_ROW apart) as q4_pairs8's B tiles of every dim, 32 keys a
 * block (d · 32 bf16 a block; a last one filled with zeros), their scales to `units`: what the
 * query blocks of a many-row pass share (step.c), so that each makes none. */
TAMXB void q4_pair_values(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units) {
  for (int64_t kb = 0; kb < count; kb += 32) {
    const int8_t *r[32];
    for (int64_t j = 0; j < 32; j++) r[j] = kb + j < count ? rows + (kb + j) * KV8_ROW(d) : 0;
    q4_pairs8(r, 0, (int)(d / 16), out + kb * d);
  }
  for (int64_t j = 0; j < count; j++) units[j] = kv8_scale(rows + j * KV8_ROW(d), d);
}

/* Rows [0, count) of 8-bit values (KV8_ROW apart, count a multiple of 4 or the last rows) as the B
 * tiles of q4_tile_values8: four keys side by side, dim by dim (key quad r's dims [16b, 16b + 16)
 * at out + r · 4d + 64b bytes: dim i's four keys at 4i), the last quad's missing keys and the
 * quads after it up to a multiple of 16 quads zeros; their scales to `units`. What a many-row
 * pass's query blocks share (step.c), as q4_dot_pairs16 for the vectors. */
TAMXB void q4_quads8(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units) {
  int64_t row = KV8_ROW(d), quads = (count + 3) / 4, filled = (quads + 15) / 16 * 16;
  int8_t *o = (int8_t *)out;
  for (int64_t r = 0; r < quads; r++)
    for (int64_t c = 0; c < d; c += 64) {
      __m512i x[4];
      for (int k = 0; k < 4; k++)
        x[k] = 4 * r + k < count ? _mm512_loadu_si512(rows + (4 * r + k) * row + c) : _mm512_setzero_si512();
      __m512i ab0 = _mm512_unpacklo_epi8(x[0], x[1]), ab1 = _mm512_unpackhi_epi8(x[0], x[1]);
      __m512i cd0 = _mm512_unpacklo_epi8(x[2], x[3]), cd1 = _mm512_unpackhi_epi8(x[2], x[3]);
      /* a 128-bit lane L of q[i]: the quads of dims 16L + 4i .. 16L + 4i + 3 */
      __m512i q0 = _mm512_unpacklo_epi16(ab0, cd0), q1 = _mm512_unpackhi_epi16(ab0, cd0);
      __m512i q2 = _mm512_unpacklo_epi16(ab1, cd1), q3 = _mm512_unpackhi_epi16(ab1, cd1);
      __m512i t0 = _mm512_shuffle_i64x2(q0, q1, 0x44), t1 = _mm512_shuffle_i64x2(q0, q1, 0xEE);
      __m512i t2 = _mm512_shuffle_i64x2(q2, q3, 0x44), t3 = _mm512_shuffle_i64x2(q2, q3, 0xEE);
      int8_t *at = o + r * 4 * d + 4 * c;
      _mm512_storeu_si512(at, _mm512_shuffle_i64x2(t0, t2, 0x88));       /* dims c .. c + 15 */
      _mm512_storeu_si512(at + 64, _mm512_shuffle_i64x2(t0, t2, 0xDD));  /* c + 16 .. */
      _mm512_storeu_si512(at + 128, _mm512_shuffle_i64x2(t1, t3, 0x88)); /* c + 32 .. */
      _mm512_storeu_si512(at + 192, _mm512_shuffle_i64x2(t1, t3, 0xDD)); /* c + 48 .. */
    }
  memset(o + quads * 4 * d, 0, (size_t)((filled - quads) * 4 * d));
  for (int64_t j = 0; j < count; j++) units[j] = kv8_scale(rows + j * row, d);
}

/* sums (n ≤ 16 rows of d int32) = Σ_j w16[m][j] · value j over keys [0, length) on the tiles:
 * each int16 weight (0 … 32767) as its high byte (`tdpbssd`) and low byte (`tdpbusd`, unsigned)
 * against q4_quads8's B tiles (`quads`, from the part's first key), 64 keys a product, and the two
 * sums joined as 256 · high + low: the exact integers of q4_dot_values8's `vpdpwssd` (an integer sum
 * has no order; the total fits in 32 bits, so the join's wrap-around is exact). The tiles are
 * configured (q4_amx_begin); w16: n rows of `stride` int16 (those from `length` on not read); a
 * part's keys, at most SPLIT. */
TAMXB void q4_tile_values8(int64_t n, int64_t d, const int8_t *quads, int64_t length, const uint16_t *w16,
                           int64_t stride, int32_t *sums) {
  int64_t chunks = (length + 63) / 64, ld = chunks * 64; /* the A planes' rows: every chunk's 64 keys */
  int8_t hi[16 * SPLIT], lo[16 * SPLIT];
  int32_t c[4][256];
  for (int64_t j0 = 0; j0 < ld; j0 += 32) { /* the weights split once for every pass (zeros past length) */
    int64_t left = length - j0 < 32 ? (length - j0 > 0 ? length - j0 : 0) : 32;
    __mmask32 keep = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
    for (int64_t m = 0; m < 16; m++) {
      __m512i w = m < n ? _mm512_maskz_loadu_epi16(keep, w16 + m * stride + j0) : _mm512_setzero_si512();
      _mm256_storeu_si256((__m256i *)(lo + m * ld + j0), _mm512_cvtepi16_epi8(w));
      _mm256_storeu_si256((__m256i *)(hi + m * ld + j0), _mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 8)));
    }
  }
  for (int64_t c2 = 0; c2 < d; c2 += 32) { /* 32 dims a pass: tiles 0-1 high sums, 2-3 low, 4-5 A, 6-7 B */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j0 = 0; j0 < ld; j0 += 64) {
      _tile_loadd(4, hi + j0, ld);
      _tile_loadd(5, lo + j0, ld);
      const int8_t *b = quads + j0 * d + 4 * c2; /* quad j0 / 4 at j0 · d bytes */
      _tile_loadd(6, b, 4 * d);
      _tile_loadd(7, b + 64, 4 * d);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int64_t m = 0; m < n; m++)
      for (int t = 0; t < 2; t++) {
        __m512i high = _mm512_loadu_si512(c[t] + 16 * m), low = _mm512_loadu_si512(c[2 + t] + 16 * m);
        _mm512_storeu_si512(sums + m * d + c2 + 16 * t, _mm512_add_epi32(_mm512_slli_epi32(high, 8), low));
      }
  }
}
#endif
