/* The many-row passes of q4gemm.c on AMX, Intel's tile matrix unit (Sapphire Rapids and later).
 *
 * A VNNI pass pays 8 `vpdpbusd` a row for each group of a tile (16 outputs × 32 inputs); AMX's
 * `tdpbssd` multiplies up to 16 rows' int8 activations (tile A: rows × 32 bytes, read straight
 * from the quantized activations with their row stride) by a group's weights (tile B: 8 quads ×
 * 16 outputs × 4 bytes, the layout's nibbles unpacked, or an 8-bit weight's bytes as they lie) in
 * one instruction. What is left a row is the float epilogue, the same instructions in the same
 * order as the VNNI passes: the integer sums are exact, so every row's result is bit for bit the
 * VNNI kernel's, whichever path a row count takes.
 *
 * The kernel asks Linux for the tile state once (`arch_prctl`); where it is refused, or the CPU
 * has no AMX, `q4_amx` says so and q4_run keeps VNNI. From which row count a weight's calls take AMX
 * is its own (`q4_layer.amx`: measured per machine and model shape, core/measure/kernels.py).
 */
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

#if !Q4_NEW_ISAS
int q4_amx(void) { return -1; }
int q4_amx_run(const q4_layer *layer, int threads, int64_t rows, const int8_t *p, const float *e, const float *s,
               uint16_t *y) {
  (void)layer, (void)threads, (void)rows, (void)p, (void)e, (void)s, (void)y;
  return -1;
}
#else

#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))
#define AMX_ROWS 16 /* rows of a tile */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for the tile state (once). Returns 0, or -1 where this process may not use AMX (no
 * AMX, or the kernel refused it): no weight may then be set to take AMX. */
int q4_amx(void) {
  static int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted ? 0 : -1;
}

/* Two sets of tiles, taken by turns (even and odd groups), so that a group's loads need not wait
 * for the last group's product to leave its tiles: sums 0 | 4 (rows × 16 int32), activations
 * 1 | 5 (rows × 32 bytes: one group), weights 2 | 6 (8 quads × 64 bytes). */
TAMX static void configure(int rows) {
  tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int set = 0; set < 8; set += 4) {
    c.rows[set] = c.rows[set + 1] = (uint8_t)rows;
    c.colsb[set] = 64;
    c.colsb[set + 1] = GROUP;
    c.rows[set + 2] = 8;
    c.colsb[set + 2] = 64;
  }
  _tile_loadconfig(&c);
}

/* One group's integer products: activations pg (row stride k) times weights b (row stride ldb). */
TAMX static inline void product(int64_t group, const int8_t *pg, int64_t k, const void *b, int64_t ldb, int32_t *sums) {
  if (group & 1) {
    _tile_loadd(5, pg, k);
    _tile_loadd(6, b, ldb);
    _tile_zero(4);
    _tile_dpbssd(4, 5, 6);
    _tile_stored(4, sums, 64);
  } else {
    _tile_loadd(1, pg, k);
    _tile_loadd(2, b, ldb);
    _tile_zero(0);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, sums, 64);
  }
}

/* The first `rows` of a pass's R rows' sums plus the bias, as bf16 outputs. */
TAMX static inline __attribute__((always_inline)) void store_rows(int R, const __m512 *acc, int64_t rows,
                                                                   const float *bias, uint16_t *y, int64_t ldy) {
  __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R && r < rows; r++) store_bf512(y + r * ldy, round_bf512(_mm512_add_ps(acc[r], bv)));
}

/* A pass is a pipeline over the groups: a group's weights are unpacked (4 bits) at step i, its
 * product runs at step i + AHEAD and its sums are scaled into the rows' registers at step
 * i + 2·AHEAD, so no load waits on the store just before it (tiles load from memory, and do not
 * take a value from a store in flight). RING ≥ 2·AHEAD + 1 buffers of each kind. */
#define AHEAD 2
#define RING 8

/* 4-bit weights: one output tile for R rows (p padded with zeros to R rows; e and s by group, R
 * rows a group), its first `rows` stored, as q4gemm.c's reg512 and pair512 compute them. */
#define AMX4(R)                                                                                                      \
  TAMX static void amx4_##R(const uint8_t *w, q4_steps st, int64_t groups,                                        \
                            const int8_t *p, const float *e, const float *s, int64_t k, int64_t rows,              \
                            const float *bias, uint16_t *y, int64_t ldy) {                                         \
    const __m512i low = _mm512_set1_epi8(15);                                                                       \
    _Alignas(64) uint8_t b[RING][8 * 64];                                                                            \
    _Alignas(64) int32_t sums[RING][R * TILE];                                                                       \
    __m512 acc[R];                                                                                                   \
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                                      \
    for (int64_t i = 0; i < groups + 2 * AHEAD; i++) {                                                               \
      if (i < groups) { /* byte 64h + 4j + i: quad 2h in the low nibble, 2h + 1 in the high */                      \
        const uint8_t *wg = w + i * TILE_BYTES;                                                                      \
        if (i + 4 < groups)                                                                                          \
          for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(wg + 4 * TILE_BYTES + 64 * l), _MM_HINT_T0);       \
        uint8_t *bi = b[i % RING];                                                                                   \
        for (int h = 0; h < 4; h++) {                                                                                \
          __m512i v = _mm512_loadu_si512((const void *)(wg + 64 * h));                                               \
          _mm512_store_si512((void *)(bi + 128 * h), _mm512_and_si512(v, low));                                     \
          _mm512_store_si512((void *)(bi + 128 * h + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));          \
        }                                                                                                            \
      }                                                                                                              \
      int64_t g = i - AHEAD;                                                                                         \
      if (g >= 0 && g < groups) product(g, p + g * GROUP, k, b[g % RING], 64, sums[g % RING]);                      \
      g = i - 2 * AHEAD;                                                                                             \
      if (g >= 0) {                                                                                                  \
        const int32_t *sg = sums[g % RING];                                                                          \
        __m512 dg = STEPS512(st, groups, 0, g), mg = MINIMUMS512(st, dg, groups, 0, g);                             \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                     \
          __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sg + 16 * r)));                           \
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dg, _mm512_set1_ps(e[g * R + r])), acc[r]);               \
          acc[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(s[g * R + r]), acc[r]);                                   \
        }                                                                                                            \
      }                                                                                                              \
    }                                                                                                                \
    store_rows(R, acc, rows, bias, y, ldy);                                                                          \
  }

/* 8-bit weights: their bytes are tile B as they lie (as q4gemm.c's pair512_8). */
#define AMX8(R)                                                                                                      \
  TAMX static void amx8_##R(const uint8_t *w, const uint16_t *d, int64_t groups, const int8_t *p, const float *e,  \
                            int64_t k, int64_t rows, const float *bias, uint16_t *y, int64_t ldy) {                \
    _Alignas(64) int32_t sums[RING][R * TILE];                                                                       \
    __m512 acc[R];                                                                                                   \
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                                      \
    for (int64_t i = 0; i < groups + AHEAD; i++) {                                                                   \
      if (i < groups) product(i, p + i * GROUP, k, w + i * TILE_BYTES8, 64, sums[i % RING]);                        \
      int64_t g = i - AHEAD;                                                                                         \
      if (g >= 0) {                                                                                                  \
        const int32_t *sg = sums[g % RING];                                                                          \
        __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(d + g * TILE)));                              \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                     \
          __m512 exact = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sg + 16 * r)));                         \
          acc[r] = _mm512_fmadd_ps(exact, _mm512_mul_ps(dg, _mm512_set1_ps(e[g * R + r])), acc[r]);             \
        }                                                                                                            \
      }                                                                                                              \
    }                                                                                                                \
    store_rows(R, acc, rows, bias, y, ldy);                                                                          \
  }

AMX4(8)
AMX4(16)
AMX8(8)
AMX8(16)

/* The rows a pass of `count` rows runs as (its tiles' row count, its kernel): 8 or 16. */
static int pass_rows(int64_t count) { return count <= 8 ? 8 : 16; }

/* e and s (rows × groups) → by group, `size` rows a group, for rows [r0, r0 + size) (zeros past
 * `rows`): a pass's broadcasts then read one place a group. */
static void by_group(const float *x, int64_t rows, int64_t groups, int64_t r0, int size, float *out) {
  for (int64_t g = 0; g < groups; g++)
    for (int r = 0; r < size; r++) out[g * size + r] = r0 + r < rows ? x[(r0 + r) * groups + g] : 0.0f;
}

/* y = the rows' products, from their quantized activations (p, e, s as q4_run makes them, p
 * padded with zeros to a multiple of 16 rows), in tasks of one output tile × 16 rows. Returns 0,
 * or -1 when its scratch memory could not be had. */
TAMX int q4_amx_run(const q4_layer *layer, int threads, int64_t rows, const int8_t *p, const float *e, const float *s,
                    uint16_t *y) {
  int64_t n = layer->n, k = layer->k, groups = k / GROUP, tiles = n / TILE;
  const int64_t stride = groups * (layer->bits == 8 ? TILE_BYTES8 : TILE_BYTES);
  int64_t chunks = (rows + AMX_ROWS - 1) / AMX_ROWS;
  float *es = malloc(sizeof(float) * (size_t)(chunks * AMX_ROWS * groups) * 2);
  if (!es) return -1;
  float *ss = es + chunks * AMX_ROWS * groups;
  for (int64_t c = 0; c < chunks; c++) {
    int size = pass_rows(rows - c * AMX_ROWS);
    by_group(e, rows, groups, c * AMX_ROWS, size, es + c * AMX_ROWS * groups);
    by_group(s, rows, groups, c * AMX_ROWS, size, ss + c * AMX_ROWS * groups);
  }
#pragma omp parallel num_threads(threads)
  {
    int configured = 0;
#pragma omp for schedule(static) collapse(2)
    for (int64_t t = 0; t < tiles; t++)
      for (int64_t c = 0; c < chunks; c++) {
        int64_t r0 = c * AMX_ROWS, count = rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS, at = t * groups * TILE;
        int size = pass_rows(count);
        if (configured != size) configure(configured = size);
        const float *bt = layer->bias ? layer->bias + t * TILE : 0;
        const int8_t *pc = p + r0 * k;
        const float *ec = es + r0 * groups, *sc = ss + r0 * groups;
        uint16_t *yt = y + r0 * n + t * TILE;
        if (layer->bits == 8)
          (size == 8 ? amx8_8 : amx8_16)(layer->w + t * stride, layer->d + at, groups, pc, ec, k, count, bt, yt, n);
        else
          (size == 8 ? amx4_8 : amx4_16)(layer->w + t * stride, tile_steps(layer, t), groups, pc, ec, sc, k, count, bt,
                                         yt, n);
      }
    if (configured) _tile_release();
  }
  free(es);
  return 0;
}
#endif
