/* What the kernel library's files share: bf16 conversions, the targets, a packed weight. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define TILE 16
#define TILE_BYTES 256 /* 16 outputs × 32 inputs × 4 bits */
#define CHUNK 64       /* rows per pass over a tile's weights */
#define TILE_BYTES8 512 /* 16 outputs × 32 inputs × 8 bits */


static inline float bf16_to_float(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}


/* AMX's and AVX-VNNI's intrinsics and targets need GCC 11 or clang 12: an older compiler builds
 * the library without them (amx.c's q4_amx and q4_avx_vnni then say no). */
#ifndef Q4_NEW_ISAS
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define Q4_NEW_ISAS 1
#else
#define Q4_NEW_ISAS 0
#endif
#endif

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define T256 __attribute__((target("avx2,fma,f16c")))
#define TVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

/* 8 or 16 bf16 values → float lanes; float lanes → the nearest bf16 values (ties to even; a NaN is
 * not kept one), still as floats; lanes that hold bf16 values → stored as bf16. */
#define LOAD_BF256(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD_BF512(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* 8 or 16 int8 values → float lanes. */
#define LOAD_I8256(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define LOAD_I8512(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
T256 static inline __m256 round_bf256(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xffff0000u)));
}
T512 static inline __m512 round_bf512(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)));
}
T256 static inline void store_bf256(uint16_t *y, __m256 v) {
  __m256i r = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  _mm_storeu_si128((void *)y, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
T512 static inline void store_bf512(uint16_t *y, __m512 v) {
  _mm256_storeu_si256((void *)y, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

/* The rows' float sums (rows × 32, `tiles` × 16 used) plus the bias, as bf16 outputs. */
T512 static inline void store_rows512(int tiles, int64_t rows, const float *acc, const float *bias, uint16_t *y,
                               int64_t ldy) {
  for (int t = 0; t < tiles; t++) {
    __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * t) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++)
      store_bf512(y + r * ldy + 16 * t, round_bf512(_mm512_add_ps(_mm512_loadu_ps(acc + r * 32 + 16 * t), bv)));
  }
}

/* e^x lane by lane for x <= 0, as 2^n · e^r, r = x - n·ln 2 (ln 2 in two parts), e^r by a
 * polynomial, to about 2 ulp (0 below -87). */
#define EXP_FLOOR -87.0f
#define EXP_LOG2E 1.44269504f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO 2.12194440e-4f /* subtracted: ln 2 = EXP_LN2_HI - EXP_LN2_LO */
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#define EXP_VEC(NAME, TARGET, VEC, P, ROUND, POW2)                                                                    \
  TARGET static inline VEC NAME(VEC x) {                                                                             \
    VEC y = P##_max_ps(x, P##_set1_ps(EXP_FLOOR));                                                                   \
    VEC n = ROUND(P##_mul_ps(y, P##_set1_ps(EXP_LOG2E)));                                                            \
    VEC r = P##_fnmadd_ps(n, P##_set1_ps(EXP_LN2_HI), y);                                                            \
    r = P##_fmadd_ps(n, P##_set1_ps(EXP_LN2_LO), r);                                                                 \
    VEC e = P##_set1_ps(EXP_P0);                                                                                     \
    e = P##_fmadd_ps(e, r, P##_set1_ps(EXP_P1));                                                                     \
    e = P##_fmadd_ps(e, r, P##_set1_ps(EXP_P2));                                                                     \
    e = P##_fmadd_ps(e, r, P##_set1_ps(EXP_P3));                                                                     \
    e = P##_fmadd_ps(e, r, P##_set1_ps(EXP_P4));                                                                     \
    e = P##_fmadd_ps(e, r, P##_set1_ps(EXP_P5));                                                                     \
    e = P##_fmadd_ps(P##_mul_ps(e, r), r, P##_add_ps(r, P##_set1_ps(1.0f)));                                         \
    return POW2(e, n);                                                                                               \
  }
#define ROUND256(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ROUND512(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* e · 2^n (n an integer ≥ -126): AVX-512's scalef, in one instruction the product with 2^n that
 * AVX2 builds from n's exponent bits (the same bits: both round the exact product once) */
#define POW2_512(e, n) _mm512_scalef_ps(e, n)
#define POW2_256(e, n)                                                                                               \
  _mm256_mul_ps(e,                                                                                                   \
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)))
EXP_VEC(exp512, T512, __m512, _mm512, ROUND512, POW2_512)
EXP_VEC(exp256, T256, __m256, _mm256, ROUND256, POW2_256)

/* A row of `padded` scores or weights (a multiple of 16; attention's softmax): its largest (exact in any order; four
 * vectors side by side, so no one chain of maxima waits on the last), and the sum of its weights
 * (each in [0, 1]: e^(score − top)) in fixed point, exact in any order: each weight rounded to a
 * multiple of 2^-21 and added as an integer (a part's ≤ SPLIT keys stay under 2^30). A float sum
 * lane by lane depended on the lanes the keys sit in, and a tree's node has its keys at other
 * slots than the one-token step at its position: ~1 node in 10 of random trees came out a last
 * bit apart (measured; tests/test_attention_values.py). */
#define SUM_UNIT 2097152.0f /* 2^21 */
T512 static inline float top512(int64_t padded, const float *s) {
  __m512 t[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                 _mm512_set1_ps(-INFINITY)};
  for (int64_t j = 0; j < padded; j += 16) t[j / 16 % 4] = _mm512_max_ps(t[j / 16 % 4], _mm512_loadu_ps(s + j));
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(t[0], t[1]), _mm512_max_ps(t[2], t[3])));
}
T256 static inline float top256(int64_t padded, const float *s) {
  __m256 t[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                 _mm256_set1_ps(-INFINITY)};
  for (int64_t j = 0; j < padded; j += 8) t[j / 8 % 4] = _mm256_max_ps(t[j / 8 % 4], _mm256_loadu_ps(s + j));
  __m256 u = _mm256_max_ps(_mm256_max_ps(t[0], t[1]), _mm256_max_ps(t[2], t[3]));
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
T512 static inline __m512i fixed512(__m512 x) { return _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(SUM_UNIT))); }
T512 static inline float sums512(int64_t padded, const float *s) {
  __m512i t = _mm512_setzero_si512();
  for (int64_t j = 0; j < padded; j += 16) t = _mm512_add_epi32(t, fixed512(_mm512_loadu_ps(s + j)));
  return (float)_mm512_reduce_add_epi32(t) / SUM_UNIT;
}
T256 static inline float sums256(int64_t padded, const float *s) {
  __m256i t = _mm256_setzero_si256();
  for (int64_t j = 0; j < padded; j += 8)
    t = _mm256_add_epi32(t, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(SUM_UNIT))));
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return (float)_mm_cvtsi128_si32(x) / SUM_UNIT;
}

/* One packed weight (core/q4.py's Layer). A 4-bit weight's steps and minimums: float16 per tile,
 * group and output (d[(t·G + g)·16 + j]), or in GGUF Q4_K's form (k6 not NULL): a byte multiplier
 * of the step and one of the minimum per tile, group and output (k6[(t·G + g)·32 + j], + 16 for
 * the minimum's), times a float16 step and minimum per tile, block of 8 groups and output
 * (d[(t·G/8 + g/8)·16 + j]): Q4_K's 6-bit scales and its d and −dmin, as the file holds them. */
typedef struct {
  int64_t n, k, bits; /* bits: 4 or 8 */
  const uint8_t *w;
  const uint16_t *d, *m; /* float16; m NULL: a symmetric weight (GGUF Q4_0's), whose minimums are −8·d */
  const float *bias;     /* or NULL */
  int64_t amx;           /* calls of this many rows or more take AMX (0: none; set only where q4_amx granted it) */
  const uint8_t *k6;     /* or NULL (see above) */
  const uint8_t *hb;     /* or NULL: a 5-bit weight's fifth bits (bits 5; see FIFTH_AT) */
} q4_layer;

/* One tile's steps and minimums (from `tile_steps`): the kernels read those of tile t from there on. */
typedef struct {
  const uint16_t *d, *m;
  const uint8_t *k6, *hb;
} q4_steps;
static inline q4_steps tile_steps(const q4_layer *layer, int64_t t) {
  int64_t groups = layer->k / GROUP, held = layer->k6 ? groups / 8 : groups; /* float16 steps a tile and output */
  q4_steps st = {layer->d + t * held * TILE, layer->m ? layer->m + t * held * TILE : 0,
                 layer->k6 ? layer->k6 + t * groups * 2 * TILE : 0, layer->hb ? layer->hb + t * groups * 64 : 0};
  return st;
}
/* Where tile t's (from st's on) float16 step of group g lies, and its byte multipliers. */
#define STEP_AT(st, groups, t, g) ((st).k6 ? ((t) * ((groups) / 8) + (g) / 8) * TILE : ((t) * (groups) + (g)) * TILE)
#define K6_AT(st, groups, t, g) ((st).k6 + ((t) * (groups) + (g)) * 2 * TILE)
/* A 5-bit weight (GGUF Q5_0, Q5_1, Q5_K: q in [0, 31]) is a 4-bit one (its q mod 16, steps and
 * minimums) and its fifth bits: per tile and group 64 bytes, eight 64-bit masks, mask 2h + half's
 * bit 4j + i being that of q[k = 8h + 4·half + i][j], the value in lane 4j + i of the half (low or
 * high nibbles) of the layout's 64 bytes h. Tile t's (from st's on) of group g: */
#define FIFTH_AT(st, groups, t, g) ((st).hb + ((t) * (groups) + (g)) * 64)
/* The lanes of v (values in [0, 15]) whose fifth bit mask `word` of `at` sets, plus 16. */
T512 static inline __m512i fifth512(__m512i v, const uint8_t *at, int word) {
  uint64_t bits;
  memcpy(&bits, at + 8 * word, 8);
  return _mm512_mask_add_epi8(v, _cvtu64_mask64(bits), v, _mm512_set1_epi8(16));
}
/* 32 bits → 32 bytes, 16 where the bit is set (AVX2: byte i takes byte i/8 of the bits, then its bit i % 8). */
T256 static inline __m256i fifth256(uint32_t bits) {
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                  _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  v = _mm256_and_si256(v, _mm256_set1_epi64x((long long)0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x((long long)0x8040201008040201ULL)), _mm256_set1_epi8(16));
}
#define BYTES512(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(p))))
#define BYTES256(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(p))))
#define HALVES512(p) _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(p)))
#define HALVES256(p) _mm256_cvtph_ps(_mm_loadu_si128((const void *)(p)))
/* Group g's 16 steps (a byte multiplier × a float16 step is exact in float: 8 × 11 bits) and 16
 * minimums: as held, or −8·d where the weight keeps none (m NULL: −8·d is what a float16 minimum
 * −8·d would hold exactly, so the bits are the same either way). */
#define STEPS512(st, groups, t, g)                                                                                   \
  ((st).k6 ? _mm512_mul_ps(BYTES512(K6_AT(st, groups, t, g)), HALVES512((st).d + STEP_AT(st, groups, t, g)))       \
           : HALVES512((st).d + STEP_AT(st, groups, t, g)))
#define MINIMUMS512(st, dg, groups, t, g)                                                                            \
  ((st).k6  ? _mm512_mul_ps(BYTES512(K6_AT(st, groups, t, g) + TILE), HALVES512((st).m + STEP_AT(st, groups, t, g))) \
   : (st).m ? HALVES512((st).m + STEP_AT(st, groups, t, g))                                                          \
            : _mm512_mul_ps((dg), _mm512_set1_ps(-8.0f)))
/* The same for the 8 outputs of half h of a tile (AVX2). */
#define STEPS256(st, groups, t, g, h)                                                                                \
  ((st).k6 ? _mm256_mul_ps(BYTES256(K6_AT(st, groups, t, g) + 8 * (h)),                                             \
                           HALVES256((st).d + STEP_AT(st, groups, t, g) + 8 * (h)))                                  \
           : HALVES256((st).d + STEP_AT(st, groups, t, g) + 8 * (h)))
#define MINIMUMS256(st, dg, groups, t, g, h)                                                                         \
  ((st).k6  ? _mm256_mul_ps(BYTES256(K6_AT(st, groups, t, g) + TILE + 8 * (h)),                                     \
                            HALVES256((st).m + STEP_AT(st, groups, t, g) + 8 * (h)))                                 \
   : (st).m ? HALVES256((st).m + STEP_AT(st, groups, t, g) + 8 * (h))                                                \
            : _mm256_mul_ps((dg), _mm256_set1_ps(-8.0f)))
/* Where the few-row and 8-bit passes prefetch the weights (q4_prefetch_l2, each kind apart): to L1
 * (`prefetcht0`, PF groups ahead), or to L2 (`prefetcht1`, twice as far), which the memory streams
 * faster into on some CPUs (an AMD EPYC, Zen 4: one row of 1.7B-shape weights 24 → 26 GB/s, the embedded
 * model's +28 %, 8-bit weights +18 %; with the AVX2 kernels 8-bit +15-20 %, 4-bit not). Chosen by timing
 * each kind both ways on the machine (core/measure/kernels.py); the same bits either way. */
extern int q4_to_l2;
#define L2_FEW 1   /* the 4- and 5-bit passes of one to four rows */
#define L2_EIGHT 2 /* the 8-bit passes */
#define PREFETCH_W(p, l2)                                                                                            \
  do {                                                                                                               \
    if (l2)                                                                                                          \
      _mm_prefetch((const char *)(p), _MM_HINT_T1);                                                                  \
    else                                                                                                             \
      _mm_prefetch((const char *)(p), _MM_HINT_T0);                                                                  \
  } while (0)

/* Prefetch group g's steps and minimums (g even: a 64-byte line holds two groups' float16 steps,
 * or two groups' multipliers and eight groups' float16 steps in Q4_K's form), to L1 or L2 (l2). */
static inline void prefetch_steps(q4_steps st, int64_t groups, int64_t t, int64_t g, int l2) {
  if (st.k6) {
    PREFETCH_W(K6_AT(st, groups, t, g), l2);
    if (g % 16) return;
  }
  PREFETCH_W(st.d + STEP_AT(st, groups, t, g), l2);
  if (st.m) PREFETCH_W(st.m + STEP_AT(st, groups, t, g), l2);
}

int q4_run(const q4_layer *layer, int isa, int threads, int64_t rows, const uint16_t *x, int64_t ldx, uint16_t *y);

/* avx2.c: one row's activations quantized per group (AVX2), and the rows' products there. */
void q4_quantize256(const uint16_t *x, int64_t k, int8_t *p, float *e, float *s);
void q4_avx2_run(const q4_layer *layer, int threads, int64_t rows, const int8_t *p, const float *e, const float *s,
                 uint16_t *y);

/* amx.c: the rows' products on AMX. */
int q4_amx_run(const q4_layer *layer, int threads, int64_t rows, const int8_t *p, const float *e, const float *s,
               uint16_t *y);

/* AMX's tile configuration (palette 1): each tile's rows and bytes a row. */
typedef struct {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Keys and values in 8 bits (ISA_KV8): a cache row of d int8 then its float scale (the row's
 * largest magnitude / 127), the value i being int8[i] · scale. */
#define KV8_ROW(d) ((d) + 4)
static inline float kv8_scale(const int8_t *row, int64_t d) {
  float scale;
  memcpy(&scale, row + d, sizeof scale);
  return scale;
}
void q4_kv8_store(const uint16_t *x, int64_t d, int8_t *row);

/* attend.c's attention of one part of the keys (q4_attend's parts), in vectors: bf16 keys and
 * values, or (_8) 8-bit ones. work: PART_WORK(n, to - from) floats. */
#define QUERIES 48   /* the most queries one pass over a kv head's keys and values serves */
#define SPLIT 512    /* the most keys of a part (step.c cuts long key ranges at its multiples) */
#define HEAD_STEP 16 /* head sizes must be multiples of this (core/backends/stepops.py HEAD_STEP) */
#define KEYS 16
#define PADDED(length) (((length) + KEYS - 1) / KEYS * KEYS)
#define PART_WORK(n, length) ((n) * PADDED(length))
#define ATTEND_ARGS                                                                                                  \
  int64_t n, int64_t d, const float *qf, const void *keys, const void *values, int64_t from, int64_t to,            \
      int64_t open, const uint16_t *const *mask, float *work, float *top, float *total, float *acc
void attend512(ATTEND_ARGS);
void attend256(ATTEND_ARGS);
void attend512_8(ATTEND_ARGS);
void attend256_8(ATTEND_ARGS);

/* step.c's softmax and weighted values of a part once its scores are made (its WEIGHTED), and
 * attend_amx.c's attention of one part with its scores on AMX. */
void weighted512(int64_t n, int64_t d, const uint16_t *v, int64_t from, int64_t to, int64_t open,
                 const uint16_t *const *mask, float *scores, float *top, float *total, float *acc);
void weighted512_8(int64_t n, int64_t d, const int8_t *v, int64_t from, int64_t to, int64_t open,
                   const uint16_t *const *mask, float *scores, float *top, float *total, float *acc);
#define ISA_VARIANT 3    /* the variant's number (1 AVX2, 2 AVX-512) in an `isa` argument, whose */
#define ISA_AMX_SCORES 4 /* added flags ask for attention's scores on AMX, */
#define ISA_AMX_VALUES 8 /* and its weighted values too (layers without a sliding window) */
#define ISA_KV8 16       /* keys and values in 8 bits (KV8_ROW) */
#define ISA_DOT 32       /* AMX's attention with its tile products in AVX-512 vectors (attend_dot.c) */
#define ISA_TILES 64     /* with ISA_DOT: the CPU has AMX's tiles and this process may use them */
#define AMX_DOT 4        /* q4_attend's `amx` plus this: ISA_DOT's */
#define AMX_TILES 8      /* and this: an 8-bit cache's integers (scores, weighted values) on the tiles */
#define AMX_MODE(amx) ((amx) & ~(AMX_DOT | AMX_TILES)) /* 1 or 2, as below */
/* q4_attend's `amx` for heads of d in a layer with a sliding window of `window` (0: none): 0
 * vectors, 1 scores on AMX, 2 scores and values on AMX; plus AMX_DOT for ISA_DOT, and with it
 * AMX_TILES for ISA_TILES over 8-bit keys (the tile unit's `tdpbssd` and attend_dot.c's `vpdpbusd`
 * make the same exact integers, as do the values' int16 weights split into two bytes: the same
 * bits, at AMX's speed for blocks of many queries; attend_amx8.c's q4_tile_values8). */
static inline int amx_mode(int isa, int64_t d, int64_t window) {
  if (!(isa & ISA_AMX_SCORES) || d % (isa & ISA_KV8 ? 64 : 32)) return 0; /* 8-bit: 64 int8 a tile row */
  int tiles = isa & ISA_DOT && isa & ISA_TILES && isa & ISA_KV8 ? AMX_TILES : 0;
  return (isa & ISA_AMX_VALUES && !window ? 2 : 1) | (isa & ISA_DOT ? AMX_DOT | tiles : 0);
}
#define AMX_QUERIES 16 /* the most queries one AMX part serves (a tile's columns) */
#define DOT_FEW 8      /* the dot kernel's passes of fewer queries make their scores a lane a key */
#define AMX_WORK(padded, d) (4608 + 40 * (d) + 9 * ((padded) + 32)) /* its scratch besides the scores, floats */
int q4_amx_attention(void);
void q4_amx_begin(void);
void q4_amx_end(void);
void q4_pair_values(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units);
void q4_dot_pairs16(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units);
void q4_quads8(const int8_t *rows, int64_t d, int64_t count, uint16_t *out, float *units);
void q4_part_amx(int amx, int kv8, int64_t n, int64_t d, const uint16_t *const *q, float scale, const void *k,
                 const void *v, const uint16_t *wide, const float *wide_units, int64_t from, int64_t to,
                 int64_t open, const uint16_t *const *mask, float *scores, float *scratch, float *top, float *total,
                 float *acc);

/* step.c's vector e^x for x <= 0, in place (count a multiple of 16, or of 8 for the AVX2 one). */
void exps512(int64_t count, float *x);
void exps256(int64_t count, float *x);

/* step.c's attention of t rows (mask rows ldm apart; keys before `open` seen by every row) and
 * the first key some row does not see. */
int q4_attend(int isa, int amx, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
              int64_t first, const uint16_t *q, int64_t ldq, const void *k, const void *v, int64_t capacity,
              const uint16_t *mask, int64_t ldm, int64_t open, float scale, uint16_t *out);
int64_t q4_first_hidden(const uint16_t *mask, int64_t t, int64_t length, int64_t ldm);
void q4_rmsnorm(int isa, int64_t rows, int64_t n, const uint16_t *x, int64_t ldx, const void *w, int wide, float eps,
                uint16_t *y);
void q4_argmax(int isa, int threads, int64_t rows, int64_t n, const uint16_t *x, int64_t ld, int64_t *out);
