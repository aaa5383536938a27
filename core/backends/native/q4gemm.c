/* A 4-bit weight × 8-bit activation matrix product for a few rows (a decoding step's tree).
 *
 * y (M×N, bf16) = x (M×K, bf16) · Wᵀ + bias, with W stored as GGUF Q4_1 stores it: per group of
 * 32 inputs, w = d·q + m with q in [0, 15]. Each row of x is quantized per group of 32 to int8
 * (a ≈ e·p, p in [-127, 127]), as llama.cpp's Q8_1, so a group's dot product is
 *     Σ w·(e·p) = d·e·Σ q·p + m·e·Σ p,
 * with Σ q·p exact in int32 (AVX-512 VNNI `vpdpbusd`, or AVX2 `vpmaddubsw` + `vpmaddwd`). The
 * offset's term takes the quantized activations' sum e·Σ p, not the exact Σ a: then the error
 * is Σ w·(e·p − a), weighted by w, rather than Σ (w − m)·(e·p − a), weighted by d·q in [0, 15d]
 * (measured on the embedded model: 2.3× the error of a matmul, and 91 % top-1 agreement with
 * the file's exact logits instead of 96 %).
 *
 * Why: torch's int4 CPU matmul unpacks the weights again for every block of 4 rows, so a tree of
 * 8 or 16 nodes costs 2–4× one row. Here a group of weights is unpacked once into registers and
 * used for every row (up to CHUNK at a time), so verifying a tree costs about what reading the weights costs.
 *
 * Every row is computed alone, in the same order whatever M is: a tree's rows equal one-row
 * products bit for bit.
 *
 * Weight layout (`q4_quantize`): tiles of 16 outputs; per tile, per group, 256 bytes: byte
 * 64h + 4j + i holds q[k = 8h + i][j] in its low nibble and q[k = 8h + 4 + i][j] in its high
 * nibble (h < 4, output j < 16, i < 4). Scales d and offsets m are float, per tile, group and
 * output, as float16: d[(t·G + g)·16 + j].
 */
#include "common.h"
/* Groups ahead whose weights the passes prefetch, past a tile's end too: there lie the next tiles,
 * which the same thread reads next (past the matrix's end a prefetch is dropped). Measured on an
 * Intel Xeon (Sapphire Rapids, 2 cores; memory streams ~24 GB/s, ~50 from its cache), alternating
 * with the former library on 1.7B-shape matrices: one row 17-19 → 22-28 GB/s (the hardware
 * prefetcher alone, and prefetches that stopped at a tile's end, left the latency exposed), 8
 * rows +6-10 %, 8-bit weights +5-10 %; whole models' one-token steps +12-15 %. */
#define PF 8       /* a many-row pass (pair512) */
#define PF_ROWS 12 /* a one-to-four-row pass (reg512; to L2: twice as far) */
#define PF8 6      /* an 8-bit pass (pair512_8; to L2: twice as far) */

int q4_version(void) { return 33; }

int q4_to_l2; /* common.h's PREFETCH_W: which passes prefetch to L2 (L2_FEW, L2_EIGHT) */

/* Which passes prefetch their weights to L2 rather than L1: the 4- and 5-bit one-to-four-row
 * passes (bit L2_FEW), the 8-bit passes (bit L2_EIGHT). Returns 0. */
int q4_prefetch_l2(int which) {
  q4_to_l2 = which & (L2_FEW | L2_EIGHT);
  return 0;
}

/* ---------------------------------------------------------------- AVX-512 VNNI */


T512 static void quantize_512(const uint16_t *x, int64_t k, int8_t *p, float *e, float *s, int32_t *sum) {
  for (int64_t g = 0; g < k / GROUP; g++) {
    const uint16_t *xg = x + g * GROUP;
    __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)xg)), 16));
    __m512 a1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(xg + 16))), 16));
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
    float scale = amax / 127.0f;
    __m512 inv = _mm512_set1_ps(scale != 0.0f ? 127.0f / amax : 0.0f);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, inv));
    _mm_storeu_si128((void *)(p + g * GROUP), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((void *)(p + g * GROUP + 16), _mm512_cvtsepi32_epi8(q1));
    sum[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    e[g] = scale;
    s[g] = scale * (float)sum[g]; /* Σ of the quantized a: see q4_run */
  }
}

/* Outputs [0, 16·TILES) of TILES adjacent tiles (1 or 2) for rows [0, rows): each group's weights
 * are unpacked into registers once and used for every row; the rows' float sums wait in `acc`
 * (rows × 32 floats, in L1). */
#define PAIR512(TILES, FIVE, NAME) /* FIVE: a 5-bit weight's pass (its fifth bits) */                               \
  T512 static void NAME##_##TILES(const uint8_t *w, q4_steps st, int64_t groups,                                    \
                                   const int8_t *p, const float *e, const float *s, int64_t k, int64_t rows,      \
                                   const float *bias, uint16_t *y, int64_t ldy, float *acc) {                     \
    const __m512i low = _mm512_set1_epi8(15);                                                                       \
    const int64_t stride = groups * TILE_BYTES; /* from one tile's weights to the next's */                         \
    memset(acc, 0, sizeof(float) * 32 * (size_t)rows);                                                              \
    for (int64_t g = 0; g < groups; g++) {                                                                           \
      __m512i b[TILES][8];                                                                                           \
      __m512 dg[TILES], mg[TILES];                                                                                   \
      for (int t = 0; t < TILES; t++) {                                                                              \
        const uint8_t *wg = w + t * stride + g * TILE_BYTES;                                                        \
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(wg + PF * TILE_BYTES + 64 * l), _MM_HINT_T0);        \
        if ((g + PF) % 2 == 0) prefetch_steps(st, groups, t, g + PF, 0);                                             \
        for (int h = 0; h < 4; h++) {                                                                                \
          __m512i v = _mm512_loadu_si512((const void *)(wg + 64 * h));                                               \
          b[t][2 * h] = _mm512_and_si512(v, low);                                                                    \
          b[t][2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                                         \
        }                                                                                                            \
        if (FIVE) { /* a 5-bit weight's fifth bits */                                                                \
          _mm_prefetch((const char *)FIFTH_AT(st, groups, t, g + PF), _MM_HINT_T0);                                 \
          for (int u = 0; u < 8; u++) b[t][u] = fifth512(b[t][u], FIFTH_AT(st, groups, t, g), u);                   \
        }                                                                                                            \
        dg[t] = STEPS512(st, groups, t, g);                                                                          \
        mg[t] = MINIMUMS512(st, dg[t], groups, t, g);                                                                \
      }                                                                                                              \
      for (int64_t r = 0; r < rows; r++) {                                                                           \
        const int8_t *pr = p + r * k + g * GROUP;                                                                    \
        __m512i dot[TILES], odd[TILES]; /* two chains a tile (integer sums: the order does not matter) */          \
        for (int t = 0; t < TILES; t++) dot[t] = odd[t] = _mm512_setzero_si512();                                   \
        _Pragma("GCC unroll 4") for (int q = 0; q < 8; q += 2) {                                                    \
          int32_t q0, q1;                                                                                            \
          memcpy(&q0, pr + 4 * q, 4);                                                                                \
          memcpy(&q1, pr + 4 * q + 4, 4);                                                                            \
          __m512i a0 = _mm512_set1_epi32(q0), a1 = _mm512_set1_epi32(q1);                                            \
          for (int t = 0; t < TILES; t++) {                                                                          \
            dot[t] = _mm512_dpbusd_epi32(dot[t], b[t][q], a0);                                                       \
            odd[t] = _mm512_dpbusd_epi32(odd[t], b[t][q + 1], a1);                                                   \
          }                                                                                                          \
        }                                                                                                            \
        for (int t = 0; t < TILES; t++) dot[t] = _mm512_add_epi32(dot[t], odd[t]);                                  \
        __m512 es = _mm512_set1_ps(e[r * groups + g]), ss = _mm512_set1_ps(s[r * groups + g]);                      \
        for (int t = 0; t < TILES; t++) {                                                                            \
          float *ar = acc + r * 32 + 16 * t;                                                                         \
          __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(dg[t], es), _mm512_loadu_ps(ar));  \
          _mm512_storeu_ps(ar, _mm512_fmadd_ps(mg[t], ss, sum));                                                     \
        }                                                                                                            \
      }                                                                                                              \
    }                                                                                                                \
    store_rows512(TILES, rows, acc, bias, y, ldy);                                                                   \
  }

PAIR512(1, 0, pair512)
PAIR512(2, 0, pair512)
PAIR512(1, 1, pair512_5)
PAIR512(2, 1, pair512_5)

/* The same for a pair of tiles and R ≤ 4 rows, with the sums in registers. */
#define REG512(R, FIVE, NAME)                                                                                        \
  T512 static void NAME##_##R(const uint8_t *w, q4_steps st, int64_t groups,                                         \
                              const int8_t *p, const float *e, const float *s, int64_t k, const float *bias,       \
                              uint16_t *y, int64_t ldy) {                                                          \
    const __m512i low = _mm512_set1_epi8(15);                                                                       \
    const int64_t stride = groups * TILE_BYTES;                                                                      \
    __m512 acc[R][2];                                                                                                \
    const int l2 = (q4_to_l2 & L2_FEW) != 0;                                                                         \
    const int64_t ahead = l2 ? 2 * PF_ROWS : PF_ROWS; /* groups ahead */                                            \
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                                       \
    for (int64_t g = 0; g < groups; g++) {                                                                           \
      __m512i dot[R][2];                                                                                             \
      for (int l = 0; l < 4; l++) {                                                                                  \
        PREFETCH_W(w + (g + ahead) * TILE_BYTES + 64 * l, l2);                                                       \
        PREFETCH_W(w + stride + (g + ahead) * TILE_BYTES + 64 * l, l2);                                              \
      }                                                                                                              \
      if ((g + ahead) % 2 == 0)                                                                                      \
        for (int t = 0; t < 2; t++) prefetch_steps(st, groups, t, g + ahead, l2);                                   \
      if (FIVE)                                                                                                      \
        for (int t = 0; t < 2; t++) PREFETCH_W(FIFTH_AT(st, groups, t, g + ahead), l2);                             \
      for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm512_setzero_si512();                                  \
      _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) {                                                         \
        __m512i v0 = _mm512_loadu_si512((const void *)(w + g * TILE_BYTES + 64 * h));                                \
        __m512i v1 = _mm512_loadu_si512((const void *)(w + stride + g * TILE_BYTES + 64 * h));                       \
        __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);            \
        __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);            \
        if (FIVE) { /* a 5-bit weight's fifth bits */                                                                \
          lo0 = fifth512(lo0, FIFTH_AT(st, groups, 0, g), 2 * h), hi0 = fifth512(hi0, FIFTH_AT(st, groups, 0, g), 2 * h + 1); \
          lo1 = fifth512(lo1, FIFTH_AT(st, groups, 1, g), 2 * h), hi1 = fifth512(hi1, FIFTH_AT(st, groups, 1, g), 2 * h + 1); \
        }                                                                                                            \
        for (int r = 0; r < R; r++) {                                                                                \
          int32_t q0, q1;                                                                                            \
          memcpy(&q0, p + r * k + g * GROUP + 8 * h, 4);                                                             \
          memcpy(&q1, p + r * k + g * GROUP + 8 * h + 4, 4);                                                         \
          __m512i a0 = _mm512_set1_epi32(q0), a1 = _mm512_set1_epi32(q1);                                            \
          dot[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][0], lo0, a0), hi0, a1);                         \
          dot[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][1], lo1, a0), hi1, a1);                         \
        }                                                                                                            \
      }                                                                                                              \
      for (int t = 0; t < 2; t++) {                                                                                  \
        __m512 dg = STEPS512(st, groups, t, g);                                                                      \
        __m512 mg = MINIMUMS512(st, dg, groups, t, g);                                                               \
        for (int r = 0; r < R; r++) {                                                                                \
          __m512 es = _mm512_set1_ps(e[r * groups + g]), ss = _mm512_set1_ps(s[r * groups + g]);                    \
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), _mm512_mul_ps(dg, es), acc[r][t]);              \
          acc[r][t] = _mm512_fmadd_ps(mg, ss, acc[r][t]);                                                            \
        }                                                                                                            \
      }                                                                                                              \
    }                                                                                                                \
    for (int t = 0; t < 2; t++) {                                                                                    \
      __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * t) : _mm512_setzero_ps();                                       \
      for (int r = 0; r < R; r++) store_bf512(y + r * ldy + 16 * t, round_bf512(_mm512_add_ps(acc[r][t], bv)));          \
    }                                                                                                                \
  }

REG512(1, 0, reg512)
REG512(2, 0, reg512)
REG512(3, 0, reg512)
REG512(4, 0, reg512)
REG512(1, 1, reg512_5)
REG512(2, 1, reg512_5)
REG512(3, 1, reg512_5)
REG512(4, 1, reg512_5)

typedef void (*reg_fn)(const uint8_t *, q4_steps, int64_t, const int8_t *, const float *, const float *, int64_t,
                       const float *, uint16_t *, int64_t);
static const reg_fn regs512[2][5] = {{0, reg512_1, reg512_2, reg512_3, reg512_4},
                                     {0, reg512_5_1, reg512_5_2, reg512_5_3, reg512_5_4}}; /* [5-bit] */

/* ---------------------------------------------------------------- 8-bit weights
 *
 * For a matrix kept at 8 bits (the embedded model's lm_head is GGUF Q8_0): w = d·q, q in
 * [-127, 127], per group of 32 inputs, laid out per tile and group as 512 bytes, byte
 * 64u + 4j + i = q[k = 4u + i][j] (u < 8 quads). VNNI multiplies unsigned by signed bytes, so
 * there a group's weights, once in registers, are shifted by 128 (q + 128 in [1, 255]) and the
 * shift comes back out exactly through the row's 128·Σp: Σ (q + 128)·p − 128·Σp = Σ q·p. The
 * shift costs an instruction a weight register, not one a row, and the layout holds no sums of
 * the weights (it held 128·Σq, 4 bytes a group and output: an eighth more bytes to read). AVX2
 * uses the sign trick; AMX multiplies signed bytes by signed bytes. */
#define PAIR512_8(TILES)                                                                                             \
  T512 static void pair512_8_##TILES(const uint8_t *w, const uint16_t *d, const int32_t *sum, int64_t groups,     \
                                     const int8_t *p, const float *e, int64_t k, int64_t rows, const float *bias, \
                                     uint16_t *y, int64_t ldy, float *acc) {                                      \
    const int64_t stride = groups * TILE_BYTES8;                                                                     \
    const __m512i shift = _mm512_set1_epi8((char)0x80);                                                              \
    const int l2 = (q4_to_l2 & L2_EIGHT) != 0;                                                                       \
    const int64_t ahead = l2 ? 2 * PF8 : PF8;                                                                        \
    memset(acc, 0, sizeof(float) * 32 * (size_t)rows);                                                              \
    for (int64_t g = 0; g < groups; g++) {                                                                           \
      __m512i b[TILES][8];                                                                                           \
      __m512 dg[TILES];                                                                                              \
      for (int t = 0; t < TILES; t++) {                                                                              \
        for (int u = 0; u < 8; u++) /* the weights `ahead` groups ahead (past a tile's end: the next tiles') */     \
          PREFETCH_W(w + t * stride + (g + ahead) * TILE_BYTES8 + 64 * u, l2);                                       \
        PREFETCH_W(d + t * groups * TILE + (g + ahead) * TILE, l2);                                                  \
        for (int u = 0; u < 8; u++)                                                                                  \
          b[t][u] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + t * stride + g * TILE_BYTES8 + 64 * u)), shift); \
        dg[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(d + t * groups * TILE + g * TILE)));               \
      }                                                                                                              \
      for (int64_t r = 0; r < rows; r++) {                                                                           \
        const int8_t *pr = p + r * k + g * GROUP;                                                                    \
        __m512i dot[TILES];                                                                                          \
        for (int t = 0; t < TILES; t++) dot[t] = _mm512_setzero_si512();                                           \
        _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) {                                                       \
          int32_t quad;                                                                                              \
          memcpy(&quad, pr + 4 * u, 4);                                                                              \
          __m512i a = _mm512_set1_epi32(quad);                                                                       \
          for (int t = 0; t < TILES; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], b[t][u], a);                          \
        }                                                                                                            \
        __m512 es = _mm512_set1_ps(e[r * groups + g]);                                                               \
        __m512i shifted = _mm512_set1_epi32(128 * sum[r * groups + g]);                                              \
        for (int t = 0; t < TILES; t++) {                                                                            \
          float *ar = acc + r * 32 + 16 * t;                                                                         \
          __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[t], shifted));                                      \
          _mm512_storeu_ps(ar, _mm512_fmadd_ps(exact, _mm512_mul_ps(dg[t], es), _mm512_loadu_ps(ar)));               \
        }                                                                                                            \
      }                                                                                                              \
    }                                                                                                                \
    store_rows512(TILES, rows, acc, bias, y, ldy);                                                                   \
  }

PAIR512_8(1)
PAIR512_8(2)

/* ---------------------------------------------------------------- entry */


/* y (rows×n, bf16) = x (rows×k, bf16, row stride ldx) · Wᵀ + bias. isa: 2 = AVX-512 VNNI,
 * 1 = AVX2. Returns 0, or -1 when a scratch buffer could not be had. */
int q4_run(const q4_layer *layer, int isa, int threads, int64_t rows, const uint16_t *x, int64_t ldx, uint16_t *y) {
  int64_t n = layer->n, k = layer->k, groups = k / GROUP, tiles = n / TILE;
  const uint8_t *w = layer->w;
  const uint16_t *d = layer->d;
  const float *bias = layer->bias;
  int amx = isa == 2 && layer->amx > 0 && rows >= layer->amx && !layer->hb; /* amx.c takes no fifth bits */
  int64_t padded = amx ? (rows + 15) / 16 * 16 : rows; /* AMX reads whole tiles of rows: the rest zeros */
  int8_t *p = malloc((size_t)(padded * k));
  float *e = malloc(sizeof(float) * (size_t)(padded * groups) * 3); /* e, s and the int32 Σp */
  if (!p || !e) {
    free(p);
    free(e);
    return -1;
  }
  float *s = e + padded * groups;
  int32_t *sum = (int32_t *)(s + padded * groups); /* a row's (AMX pads none: it uses none) */
  if (padded > rows) {
    memset(p + rows * k, 0, (size_t)((padded - rows) * k));
    memset(e + rows * groups, 0, sizeof(float) * (size_t)((padded - rows) * groups));
    memset(s + rows * groups, 0, sizeof(float) * (size_t)((padded - rows) * groups));
  }
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * k >= 4096)
  for (int64_t r = 0; r < rows; r++) {
    if (isa == 2)
      quantize_512(x + r * ldx, k, p + r * k, e + r * groups, s + r * groups, sum + r * groups);
    else
      q4_quantize256(x + r * ldx, k, p + r * k, e + r * groups, s + r * groups);
  }
  if (amx) {
    int code = q4_amx_run(layer, threads, rows, p, e, s, y);
    free(p);
    free(e);
    return code;
  }
  int eight = layer->bits == 8, five = layer->hb != 0;
  const int64_t stride = groups * (eight ? TILE_BYTES8 : TILE_BYTES); /* a tile's weight bytes */
  if (isa == 2) {
    /* tasks: pairs of tiles (the last may be a single tile) × chunks of CHUNK rows */
    int64_t pairs = (tiles + 1) / 2, chunks = (rows + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t pair = 0; pair < pairs; pair++)
      for (int64_t c = 0; c < chunks; c++) {
        float acc[CHUNK * 32];
        int64_t t = 2 * pair, r0 = c * CHUNK, count = rows - r0 < CHUNK ? rows - r0 : CHUNK, at = t * groups * TILE;
        const uint8_t *wt = w + t * stride;
        const float *bt = bias ? bias + t * TILE : 0;
        uint16_t *yt = y + r0 * n + t * TILE;
        int two = t + 1 < tiles;
        if (eight)
          (two ? pair512_8_2 : pair512_8_1)(wt, d + at, sum + r0 * groups, groups, p + r0 * k, e + r0 * groups,
                                            k, count, bt, yt, n, acc);
        else if (two && count <= 4)
          regs512[five][count](wt, tile_steps(layer, t), groups, p + r0 * k, e + r0 * groups, s + r0 * groups, k, bt, yt, n);
        else
          (five ? (two ? pair512_5_2 : pair512_5_1) : (two ? pair512_2 : pair512_1))(
              wt, tile_steps(layer, t), groups, p + r0 * k, e + r0 * groups, s + r0 * groups,
                                        k, count, bt, yt, n, acc);
      }
  } else {
    q4_avx2_run(layer, threads, rows, p, e, s, y);
  }
  free(p);
  free(e);
  return 0;
}

