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
