/* What attend_amx.c (attention on AMX) and attend_amx8.c (its 8-bit keys' and values' parts)
 * share: the target, the tiles' keys, a register transpose. */
#pragma once
#include "common.h"

#if Q4_NEW_ISAS
#define TAMXB                                                                                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16,amx-int8")))
#define KEYS16 16 /* keys a tile's rows hold */
#define AHEAD 32  /* keys ahead whose keys (and values, to L2) the scores prefetch */

/* r[i][j] ← r[j][i]: a 16 × 16 block of floats transposed in registers. */
TAMXB static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}

/* attend_amx8.c's: the scores of an 8-bit cache's keys, and 8-bit values as B tiles. */
TAMXB void q4_scores_amx8(int dot, int64_t n, int64_t d, const uint16_t *const *q, float scale, const int8_t *k,
                          const int8_t *v, float *units,
                          int64_t length, int64_t padded, float *tile, int8_t *qt, int8_t *tail, float *qs,
                          float *s);
TAMXB void q4_pairs8(const int8_t *const *rows, int64_t c, int tiles, uint16_t *out);
TAMXB void q4_tile_values8(int64_t n, int64_t d, const int8_t *quads, int64_t length, const uint16_t *w16,
                           int64_t stride, int32_t *sums);

/* attend_dot.c's: the tile products in AVX-512 vectors (`dot`: a pass on a CPU without AMX). A
 * pass of fewer queries than DOT_FEW (common.h) makes its scores a lane a key. */
TAMXB void q4_dot_product(int rows, int tiles, const void *a, int64_t lda, const uint16_t *pairs, float *c);
TAMXB void q4_dot_scores(int64_t d, const uint32_t *qt, const uint16_t *rows, float *tile);
TAMXB void q4_dot_scores_few(int64_t n, int64_t d, const uint32_t *qt, const uint16_t *rows, float scale, float *s,
                             int64_t padded);
TAMXB void q4_dot_scores8(int64_t d, const uint32_t *qt, const int8_t *rows, int64_t row, int32_t *tile);
TAMXB void q4_dot_scores8_few(int64_t n, int64_t d, const uint32_t *qu, const int8_t *rows, int64_t row,
                              const float *ks, const float *qs, float *s, int64_t padded);
TAMXB void q4_dot_values8(int tiles, int64_t n, int64_t d, const int8_t *v, const int16_t *wide, int64_t length,
                          const float *p, int64_t padded, const float *most, uint16_t *w16, int64_t stride, float *acc);
#endif
