/* Attention's scores on AMX, Intel's tile matrix unit (Sapphire Rapids and later).
 *
 * step.c's vector kernel spends most of a many-query pass (a prompt's prefill, a tree at a long
 * context) on the scores: per key and query, four fused adds and a reduction of 16 lanes. Here
 * one `tdpbf16ps` makes 16 keys' scores for 16 queries, with no reduction: tile A is 16 keys as
 * they lie in the cache (32 bf16 of each a tile, read with the cache's row stride), tile B the
 * queries' matching halves side by side (two bf16 of each query a 4-byte column), so the product
 * is the scores transposed (a row a key, a lane a query), gathered back to a row a query, scaled.
 * The softmax and weighted values are then step.c's (WEIGHTED), unchanged.
 *
 * A score's bits depend on its query's and its key's values only (the tile unit's sum over the
 * head is the same for every pair), so a tree's node still gets the bits of a one-token step at
 * its position. The scores differ from the vector kernel's in their last bits (another order of
 * sums, the scale applied after), so a model runs one or the other for its whole session (its
 * measured choice: core/measure/kernels.py).
 */
#include "common.h"

#if !Q4_NEW_ISAS
int q4_amx_scores(void) { return -1; }
void q4_amx_begin(void) {}
void q4_amx_end(void) {}
void q4_part_amx(int64_t n, int64_t d, const uint16_t *const *q, float scale, const uint16_t *k, const uint16_t *v,
                 int64_t from, int64_t to, int64_t open, const uint16_t *const *mask, float *scores, float *scratch,
                 float *top, float *total, float *acc) {
  (void)n, (void)d, (void)q, (void)scale, (void)k, (void)v, (void)from, (void)to, (void)open, (void)mask;
  (void)scores, (void)scratch, (void)top, (void)total, (void)acc;
}
#else

#define TAMXB __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-bf16")))
#define KEYS16 16 /* keys a tile's rows hold */
#define AHEAD 32  /* keys ahead whose keys the scores prefetch */

/* 0 where this build has the AMX-BF16 kernel (the CPU's and Linux's say: stepops.py). */
int q4_amx_scores(void) { return 0; }

/* A thread's tiles for q4_part_amx (before its first part; q4_amx_end after its last): three of
 * 16 rows × 64 bytes. */
TAMXB void q4_amx_begin(void) {
  /* static: GCC took the stores to a local one for dead (the instruction's read unseen) */
  static const tile_config cfg = {.palette = 1, .colsb = {64, 64, 64}, .rows = {16, 16, 16}};
  _tile_loadconfig(&cfg);
}

TAMXB void q4_amx_end(void) { _tile_release(); }

/* s (n rows of `padded`): the scores of queries q[0, n) (bf16 rows) against the keys k[0, length)
 * (d apart), times `scale`; rows' entries from `length` on are 0 (WEIGHTED hides them). Scratch:
 * tile (256 floats), qt (8·d: the queries as tile B, d / 32 tiles), tail (16·d bf16: the last
 * keys, zero-padded, so that no tile reads past the cache's `length`). */
TAMXB static void scores_amx(int64_t n, int64_t d, const uint16_t *const *q, float scale, const uint16_t *k,
                             int64_t length, int64_t padded, float *tile, uint32_t *qt, uint16_t *tail, float *s) {
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
    for (int64_t b = 0; j0 + AHEAD + KEYS16 <= length && b < KEYS16 * d * 2; b += 64) /* the cache's keys ahead */
      _mm_prefetch((const char *)(k + (j0 + AHEAD) * d) + b, _MM_HINT_T0);
    _tile_zero(0);
    for (int64_t c = 0; c < chunks; c++) {
      _tile_loadd(1, rows + 32 * c, d * (int64_t)sizeof(uint16_t));
      _tile_loadd(2, qt + c * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, tile, 64); /* a row a key, a lane a query */
    for (int64_t m = 0; m < n; m++) {
      __m512 x = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32((int)m)), tile, 4);
      _mm512_storeu_ps(s + m * padded + j0, _mm512_mul_ps(x, sc));
    }
  }
}

/* One part's attention for up to AMX_QUERIES queries (step.c's ATTEND: the part's top, sum of
 * weights and weighted values), its scores on AMX; q: the queries' bf16 rows; d a multiple of 32;
 * scores: n rows of the part's keys padded to 16; scratch: AMX_WORK(d) floats. */
TAMXB void q4_part_amx(int64_t n, int64_t d, const uint16_t *const *q, float scale, const uint16_t *k, const uint16_t *v,
                       int64_t from, int64_t to, int64_t open, const uint16_t *const *mask, float *scores,
                       float *scratch, float *top, float *total, float *acc) {
  int64_t length = to - from, padded = (length + KEYS16 - 1) / KEYS16 * KEYS16;
  uint32_t *qt = (uint32_t *)(scratch + 256);
  scores_amx(n, d, q, scale, k + from * d, length, padded, scratch, qt, (uint16_t *)(qt + 8 * d), scores);
  weighted512(n, d, v, from, to, open, mask, scores, top, total, acc);
}
#endif
