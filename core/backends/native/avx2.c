/* The AVX2 variant's passes of q4gemm.c (CPUs without AVX-512), and on AVX-VNNI where the CPU
 * has it (Intel's client CPUs): the same layouts and the same exact integer sums, so the same
 * bits as each other; rows a pass: ROWS256, every row computed alone as in q4gemm.c. 8-bit
 * weights use the sign trick (|w| times a with w's sign), as q4gemm.c's 8-bit section says. */
#include "common.h"

typedef void (*tile_fn)(const uint8_t *, q4_steps, int64_t, const int8_t *, const float *, const float *, int64_t,
                        const float *, uint16_t *, int64_t);



T256 static inline float hmax256(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

T256 static inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

T256 void q4_quantize256(const uint16_t *x, int64_t k, int8_t *p, float *e, float *s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < k / GROUP; g++) {
    const uint16_t *xg = x + g * GROUP;
    __m256 a[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      a[i] = LOAD_BF256(xg + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, a[i]));
    }
    float amax = hmax256(mx);
    float scale = amax / 127.0f;
    __m256 inv = _mm256_set1_ps(scale != 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv));
    __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i bytes = _mm256_packs_epi16(q01, q23); /* lanes interleaved: undo with a dword permute */
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((void *)(p + g * GROUP), bytes);
    e[g] = scale;
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    s[g] = scale * hsum256(_mm256_cvtepi32_ps(sum)); /* Σ of the quantized a: see q4_run */
  }
}

/* Groups ahead whose weights a pass prefetches, past its tile's end too (the next tile's, which
 * the same thread reads next): on an Intel Xeon under these kernels, one row of 1.7B-shape
 * matrices from memory 14.5 → 17 GB/s at 4 bits, 23 → 32 GB/s at 8 (q4gemm.c's PF_ROWS). */
#define PF_TILE 12 /* to L2 (q4_prefetch_l2): twice as far */

/* Rows [0, R) of one tile, both halves (8 outputs each) from one broadcast of the activations.
 * A group's products are summed in int16: each of its 8 `vpmaddubsw` pairs is at most
 * 2·15·127 = 3810 in size, so their sum stays below 32767; then one `vpmaddwd` to int32 (a 5-bit
 * weight's, 2·31·127 = 7874, half a group at a time). */
#define TILE256(R, NAME, TARGET, ADD, FINISH, FIVE) /* FIVE: a 5-bit weight's pass */                              \
  TARGET static void NAME##_##R(const uint8_t *w, q4_steps st, int64_t groups,                                      \
                               const int8_t *p, const float *e, const float *s, int64_t k, const float *bias,       \
                               uint16_t *y, int64_t ldy) {                                                          \
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1); /* ones: AVX2's FINISH */               \
    (void)ones;                                                                                                      \
    float acc[R][16];                                                                                                \
    const int l2 = (q4_to_l2 & L2_FEW) != 0;                                                                         \
    const int64_t ahead = l2 ? 2 * PF_TILE : PF_TILE;                                                                \
    memset(acc, 0, sizeof acc);                                                                                      \
    for (int64_t g = 0; g < groups; g++) {                                                                           \
      const uint8_t *wg = w + g * TILE_BYTES;                                                                        \
      for (int l = 0; l < 4; l++) PREFETCH_W(wg + ahead * TILE_BYTES + 64 * l, l2);                                  \
      if ((g + ahead) % 2 == 0) prefetch_steps(st, groups, 0, g + ahead, l2);                                       \
      __m256i sum[R][2], wide[R][2]; /* wide: a 5-bit weight's first half of the group, in int32 */                \
      for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = wide[r][0] = wide[r][1] = _mm256_setzero_si256();        \
      if (FIVE) PREFETCH_W(FIFTH_AT(st, groups, 0, g + ahead), l2);                                                 \
      for (int h = 0; h < 4; h++) {                                                                                  \
        __m256i v0 = _mm256_loadu_si256((const void *)(wg + 64 * h));                                                \
        __m256i v1 = _mm256_loadu_si256((const void *)(wg + 64 * h + 32));                                           \
        __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);            \
        __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);            \
        if (FIVE) { /* the fifth bits; int16 sums of 31·127 products would overflow past half a group */           \
          uint32_t bits[4];                                                                                          \
          memcpy(bits, FIFTH_AT(st, groups, 0, g) + 16 * h, sizeof bits); /* masks 2h, 2h + 1: j < 8, j ≥ 8 */      \
          lo0 = _mm256_or_si256(lo0, fifth256(bits[0])), lo1 = _mm256_or_si256(lo1, fifth256(bits[1]));            \
          hi0 = _mm256_or_si256(hi0, fifth256(bits[2])), hi1 = _mm256_or_si256(hi1, fifth256(bits[3]));            \
          if (h == 2)                                                                                                \
            for (int r = 0; r < R; r++)                                                                              \
              for (int half = 0; half < 2; half++)                                                                   \
                wide[r][half] = FINISH(sum[r][half]), sum[r][half] = _mm256_setzero_si256();                         \
        }                                                                                                            \
        for (int r = 0; r < R; r++) {                                                                                \
          const int8_t *pr = p + r * k + g * GROUP + 8 * h;                                                          \
          int32_t lo4, hi4;                                                                                          \
          memcpy(&lo4, pr, 4);                                                                                       \
          memcpy(&hi4, pr + 4, 4);                                                                                   \
          __m256i a0 = _mm256_set1_epi32(lo4), a1 = _mm256_set1_epi32(hi4);                                          \
          sum[r][0] = ADD(ADD(sum[r][0], lo0, a0), hi0, a1);                                                         \
          sum[r][1] = ADD(ADD(sum[r][1], lo1, a0), hi1, a1);                                                         \
        }                                                                                                            \
      }                                                                                                              \
      for (int half = 0; half < 2; half++) {                                                                         \
        __m256 dg = STEPS256(st, groups, 0, g, half), mg = MINIMUMS256(st, dg, groups, 0, g, half);                 \
        for (int r = 0; r < R; r++) {                                                                                \
          int64_t eg = r * (k / GROUP) + g;                                                                          \
          __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(FINISH(sum[r][half]), wide[r][half]));                    \
          __m256 a = _mm256_fmadd_ps(dot, _mm256_mul_ps(dg, _mm256_set1_ps(e[eg])), _mm256_loadu_ps(acc[r] + 8 * half)); \
          _mm256_storeu_ps(acc[r] + 8 * half, _mm256_fmadd_ps(mg, _mm256_set1_ps(s[eg]), a));                        \
        }                                                                                                            \
      }                                                                                                              \
    }                                                                                                                \
    for (int half = 0; half < 2; half++) {                                                                           \
      __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * half) : _mm256_setzero_ps();                                     \
      for (int r = 0; r < R; r++)                                                                                    \
        store_bf256(y + r * ldy + 8 * half, round_bf256(_mm256_add_ps(_mm256_loadu_ps(acc[r] + 8 * half), bv))); \
    }                                                                                                                \
  }

#define ROWS256 4 /* rows a pass (measured: 3 is no faster, though 4 leaves no spare register) */
/* AVX2: a group's products summed in int16 (`vpmaddubsw`), then to int32 once; AVX-VNNI
 * (`vpdpbusd` on 256 bits, Intel's client CPUs without AVX-512): straight to int32. The sums are
 * exact either way, so the two give the same bits. */
#define ADD16(sum, w, a) _mm256_add_epi16(sum, _mm256_maddubs_epi16(w, a))
#define TO32(sum) _mm256_madd_epi16(sum, ones)
#define ADD32(sum, w, a) _mm256_dpbusd_avx_epi32(sum, w, a)
#define AS32(sum) (sum)
/* A pass for each row count up to ROWS256. */
#define TILES256(NAME, TARGET, ADD, FINISH, FIVE)                                                                    \
  TILE256(1, NAME, TARGET, ADD, FINISH, FIVE)                                                                        \
  TILE256(2, NAME, TARGET, ADD, FINISH, FIVE)                                                                        \
  TILE256(3, NAME, TARGET, ADD, FINISH, FIVE)                                                                        \
  TILE256(4, NAME, TARGET, ADD, FINISH, FIVE)
TILES256(tile256, T256, ADD16, TO32, 0)
TILES256(tile256_5, T256, ADD16, TO32, 1)
#if Q4_NEW_ISAS
TILES256(tilevnni, TVNNI, ADD32, AS32, 0)
TILES256(tilevnni_5, TVNNI, ADD32, AS32, 1)
#else /* never taken: q4_avx_vnni says no */
#define tilevnni_1 tile256_1
#define tilevnni_2 tile256_2
#define tilevnni_3 tile256_3
#define tilevnni_4 tile256_4
#define tilevnni_5_1 tile256_5_1
#define tilevnni_5_2 tile256_5_2
#define tilevnni_5_3 tile256_5_3
#define tilevnni_5_4 tile256_5_4
#endif

static const tile_fn tiles256[2][2][ROWS256 + 1] = { /* [AVX-VNNI][5-bit][rows] */
    {{0, tile256_1, tile256_2, tile256_3, tile256_4}, {0, tile256_5_1, tile256_5_2, tile256_5_3, tile256_5_4}},
    {{0, tilevnni_1, tilevnni_2, tilevnni_3, tilevnni_4}, {0, tilevnni_5_1, tilevnni_5_2, tilevnni_5_3, tilevnni_5_4}}};

/* AVX2, 8-bit weights: rows [0, R) of one tile, half by half. */
#define TILE256_8(R, NAME, TARGET, DOT)                                                                              \
  TARGET static void NAME##_##R(const uint8_t *w, const uint16_t *d, int64_t groups, const int8_t *p,             \
                                 const float *e, int64_t k, const float *bias, uint16_t *y, int64_t ldy) {        \
    const __m256i ones = _mm256_set1_epi16(1); /* AVX2's DOT */                                                      \
    (void)ones;                                                                                                      \
    const int l2 = (q4_to_l2 & L2_EIGHT) != 0;                                                                       \
    const int64_t ahead = l2 ? 2 * PF_TILE : PF_TILE;                                                                \
    for (int half = 0; half < 2; half++) {                                                                           \
      __m256 acc[R];                                                                                                 \
      for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                                    \
      for (int64_t g = 0; g < groups; g++) {                                                                         \
        __m256i dot[R];                                                                                              \
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();                                               \
        for (int u = 0; u < 8; u++) /* `ahead` groups ahead (the second half's: the next tile's at its end) */    \
          PREFETCH_W(w + (g + ahead) * TILE_BYTES8 + 64 * u, l2);                                                    \
        for (int u = 0; u < 8; u++) {                                                                                \
          __m256i wv = _mm256_loadu_si256((const void *)(w + g * TILE_BYTES8 + 64 * u + 32 * half));                 \
          __m256i aw = _mm256_sign_epi8(wv, wv);                                                                     \
          for (int r = 0; r < R; r++) {                                                                              \
            int32_t quad;                                                                                            \
            memcpy(&quad, p + r * k + g * GROUP + 4 * u, 4);                                                         \
            __m256i sa = _mm256_sign_epi8(_mm256_set1_epi32(quad), wv);                                              \
            dot[r] = DOT(dot[r], aw, sa);                                                                            \
          }                                                                                                          \
        }                                                                                                            \
        __m256 dg = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(d + g * TILE + 8 * half)));                     \
        for (int r = 0; r < R; r++)                                                                                  \
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dg, _mm256_set1_ps(e[r * (k / GROUP) + g])), acc[r]); \
      }                                                                                                              \
      __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * half) : _mm256_setzero_ps();                                     \
      for (int r = 0; r < R; r++) store_bf256(y + r * ldy + 8 * half, round_bf256(_mm256_add_ps(acc[r], bv)));     \
    }                                                                                                                \
  }

#define DOT16(dot, w, a) _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones))
TILE256_8(1, tile256_8, T256, DOT16)
TILE256_8(2, tile256_8, T256, DOT16)
TILE256_8(3, tile256_8, T256, DOT16)
TILE256_8(4, tile256_8, T256, DOT16)
#if Q4_NEW_ISAS
TILE256_8(1, tilevnni_8, TVNNI, ADD32)
TILE256_8(2, tilevnni_8, TVNNI, ADD32)
TILE256_8(3, tilevnni_8, TVNNI, ADD32)
TILE256_8(4, tilevnni_8, TVNNI, ADD32)
#else
#define tilevnni_8_1 tile256_8_1
#define tilevnni_8_2 tile256_8_2
#define tilevnni_8_3 tile256_8_3
#define tilevnni_8_4 tile256_8_4
#endif

typedef void (*tile8_fn)(const uint8_t *, const uint16_t *, int64_t, const int8_t *, const float *, int64_t,
                         const float *, uint16_t *, int64_t);
static const tile8_fn tiles256_8[2][ROWS256 + 1] = {{0, tile256_8_1, tile256_8_2, tile256_8_3, tile256_8_4},
                                                     {0, tilevnni_8_1, tilevnni_8_2, tilevnni_8_3, tilevnni_8_4}};

static int avx_vnni; /* whether the AVX2 variant's passes take AVX-VNNI (`q4_avx_vnni`) */

/* Take AVX-VNNI in the AVX2 variant (on: 1) or not (0). Returns 0, or -1 where the CPU has none. */
int q4_avx_vnni(int on) {
#if Q4_NEW_ISAS
  if (!__builtin_cpu_supports("avxvnni")) return -1;
  avx_vnni = on != 0;
  return 0;
#else
  (void)on;
  return -1;
#endif
}

/* The rows' products from their quantized activations (p, e, s as q4_run makes them): tasks of
 * one tile × ROWS256 rows. */
void q4_avx2_run(const q4_layer *layer, int threads, int64_t rows, const int8_t *p, const float *e, const float *s,
                 uint16_t *y) {
  int64_t n = layer->n, k = layer->k, groups = k / GROUP, tiles = n / TILE;
  const uint8_t *w = layer->w;
  const uint16_t *d = layer->d;
  const float *bias = layer->bias;
  int eight = layer->bits == 8;
  const int64_t stride = groups * (eight ? TILE_BYTES8 : TILE_BYTES); /* a tile's weight bytes */
  int64_t passes = (rows + ROWS256 - 1) / ROWS256;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
  for (int64_t t = 0; t < tiles; t++)
    for (int64_t pass = 0; pass < passes; pass++) {
      int64_t r0 = pass * ROWS256, count = rows - r0 < ROWS256 ? rows - r0 : ROWS256, at = t * groups * TILE;
      const float *bt = bias ? bias + t * TILE : 0;
      if (eight)
        tiles256_8[avx_vnni][count](w + t * stride, d + at, groups, p + r0 * k, e + r0 * groups, k, bt,
                                    y + r0 * n + t * TILE, n);
      else
        tiles256[avx_vnni][layer->hb != 0][count](w + t * stride, tile_steps(layer, t), groups, p + r0 * k, e + r0 * groups,
                                  s + r0 * groups, k, bt, y + r0 * n + t * TILE, n);
    }
}
