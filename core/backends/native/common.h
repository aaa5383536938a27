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


static inline float bf16_to_float(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* e^x as 2^n · e^r, r = x - n·ln 2 (ln 2 in two parts), e^r by a polynomial, to about 2 ulp (0
 * below -87): step.c's vector loop's constants (EXPS). */
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

static inline uint16_t float_to_bf16(float f) { /* round to nearest even */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}


#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define T256 __attribute__((target("avx2,fma,f16c")))

/* One packed weight (core/q4.py's Layer). */
typedef struct {
  int64_t n, k, bits; /* bits: 4 or 8 */
  const uint8_t *w;
  const uint16_t *d, *m; /* float16 */
  const float *bias;     /* or NULL */
} q4_layer;

int q4_run(const q4_layer *layer, int isa, int threads, int64_t rows, const uint16_t *x, int64_t ldx, uint16_t *y);

/* step.c's vector e^x for x <= 0, in place (count a multiple of 16, or of 8 for the AVX2 one). */
void exps512(int64_t count, float *x);
void exps256(int64_t count, float *x);

/* step.c's attention of t rows (mask rows ldm apart; keys before `open` seen by every row) and
 * the first key some row does not see. */
int q4_attend(int isa, int threads, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
              const uint16_t *q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t capacity,
              const uint16_t *mask, int64_t ldm, int64_t open, float scale, uint16_t *out);
int64_t q4_first_hidden(const uint16_t *mask, int64_t t, int64_t length, int64_t ldm);
void q4_rmsnorm(int isa, int64_t rows, int64_t n, const uint16_t *x, int64_t ldx, const void *w, int wide, float eps,
                uint16_t *y);
