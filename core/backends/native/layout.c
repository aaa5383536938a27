/* A weight's layout for the kernels (q4gemm.c's top describes it): quantizing into it, laying a
 * file's blocks out in it as they are, and reading 8-bit rows back. */
#include "common.h"

static inline void pack_group(const uint8_t *v, int64_t j, uint8_t *o);

/* A float16 a 256-weight block's 8 steps (or minimums' magnitudes) are whole multiples of: the
 * largest / 255 rounded up (so none needs a multiplier over 255), and each one's multiplier,
 * rounded up (so a group's range still fits 15 steps), exact as the kernels multiply them. */
__attribute__((target("f16c"))) static uint16_t block_unit(const float *x, uint8_t *times) {
  float top = 0.0f;
  for (int g = 0; g < 8; g++) top = x[g] > top ? x[g] : top;
  uint16_t h = _cvtss_sh(top / 255.0f, 2); /* rounded toward +inf */
  float unit = _cvtsh_ss(h);
  for (int g = 0; g < 8; g++) {
    float c = unit > 0.0f ? ceilf(x[g] / unit) : 0.0f;
    if (c * unit < x[g]) c += 1.0f;
    times[g] = (uint8_t)(c > 255.0f ? 255.0f : c);
  }
  return h;
}

/* One row in Q4_K's form (q4_layer): per group the minimum min(w_min, 0) and the step (max −
 * minimum)/15, each as a byte multiple of its block's unit (block_unit), then q = round((w −
 * minimum)/step) in [0, 15] with the step and minimum the kernels will use. */
__attribute__((target("f16c"))) static void quantize_k_row(const uint16_t *w, int64_t row, int64_t k, uint8_t *out,
                                                           uint16_t *d, uint16_t *m, uint8_t *k6) {
  int64_t groups = k / GROUP, t = row / TILE, j = row % TILE;
  for (int64_t b = 0; b < groups / 8; b++) {
    float v[8][GROUP], low[8], high[8], step[8];
    uint8_t sc[8], mn[8];
    for (int g = 0; g < 8; g++) {
      low[g] = 0.0f, high[g] = -INFINITY;
      for (int i = 0; i < GROUP; i++) {
        v[g][i] = bf16_to_float(w[row * k + (8 * b + g) * GROUP + i]);
        low[g] = v[g][i] < low[g] ? v[g][i] : low[g];
        high[g] = v[g][i] > high[g] ? v[g][i] : high[g];
      }
      low[g] = -low[g]; /* its magnitude */
    }
    uint16_t lh = block_unit(low, mn);
    for (int g = 0; g < 8; g++) step[g] = (high[g] + _cvtsh_ss(lh) * mn[g]) / 15.0f;
    uint16_t dh = block_unit(step, sc);
    for (int g = 0; g < 8; g++) {
      int64_t at = (t * groups + 8 * b + g) * 2 * TILE + j;
      float unit = _cvtsh_ss(dh) * sc[g], least = -(_cvtsh_ss(lh) * mn[g]);
      uint8_t q[GROUP];
      for (int i = 0; i < GROUP; i++) {
        float a = unit > 0.0f ? nearbyintf((v[g][i] - least) / unit) : 0.0f;
        q[i] = (uint8_t)(a < 0 ? 0 : a > 15 ? 15 : a);
      }
      pack_group(q, j, out + (t * groups + 8 * b + g) * TILE_BYTES);
      k6[at] = sc[g], k6[at + TILE] = mn[g];
    }
    d[(t * (groups / 8) + b) * TILE + j] = dh;
    m[(t * (groups / 8) + b) * TILE + j] = lh ^ 0x8000; /* −: the minimums are subtracted */
  }
}

/* bf16 weights (N×K, N % 16 == 0, K % 32 == 0) → the kernel's layout in one pass, as core/q4.py's
 * quantize (4 bits: step = (max − min)/15 and q = round((w − min)/step) per group, d and m float16
 * step and min) or quantize8 (8 bits: step = max|w|/127, q = round(w/step); no m); 4 bits with k6
 * (K % 256 == 0): in Q4_K's form (quantize_k_row). */
__attribute__((target("f16c"))) void q4_quantize(const uint16_t *w, int64_t n, int64_t k, int bits, uint8_t *out,
                                                 uint16_t *d, uint16_t *m, uint8_t *k6) {
  int64_t groups = k / GROUP;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < n; row++) {
    if (bits == 4 && k6) {
      quantize_k_row(w, row, k, out, d, m, k6);
      continue;
    }
    int64_t t = row / TILE, j = row % TILE;
    for (int64_t g = 0; g < groups; g++) {
      float v[GROUP], low = INFINITY, high = -INFINITY, top = 0.0f;
      for (int i = 0; i < GROUP; i++) {
        v[i] = bf16_to_float(w[row * k + g * GROUP + i]);
        low = v[i] < low ? v[i] : low;
        high = v[i] > high ? v[i] : high;
        top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
      }
      int64_t at = (t * groups + g) * TILE + j;
      if (bits == 4) {
        float step = (high - low) / 15.0f;
        step = step < 1e-12f ? 1e-12f : step;
        uint8_t *o = out + (t * groups + g) * TILE_BYTES;
        for (int h = 0; h < 4; h++)
          for (int i = 0; i < 4; i++) {
            float a = nearbyintf((v[8 * h + i] - low) / step), b = nearbyintf((v[8 * h + 4 + i] - low) / step);
            int qa = a < 0 ? 0 : a > 15 ? 15 : (int)a, qb = b < 0 ? 0 : b > 15 ? 15 : (int)b;
            o[64 * h + 4 * j + i] = (uint8_t)(qa | (qb << 4));
          }
        d[at] = _cvtss_sh(step, 0);
        m[at] = _cvtss_sh(low, 0);
      } else {
        float step = top / 127.0f;
        step = step < 1e-12f ? 1e-12f : step;
        int8_t *o = (int8_t *)out + (t * groups + g) * 512;
        for (int u = 0; u < 8; u++)
          for (int i = 0; i < 4; i++) {
            float a = nearbyintf(v[4 * u + i] / step);
            int q = a < -127 ? -127 : a > 127 ? 127 : (int)a;
            o[64 * u + 4 * j + i] = (int8_t)q;
          }
        d[at] = _cvtss_sh(step, 0);
      }
    }
  }
}

/* Rows `ids` (n of them) of an 8-bit weight as the kernels multiply them, q · step rounded to bf16
 * (out: n × K): a tied lm_head read as the embedding (core/backends/lean/packed.py's eight_bit_rows,
 * whose torch ops cost a one-token step ~0.13 ms). Per tile and group, byte 64u + 4j + i holds output
 * j's input 4u + i. Returns 0, or -1 for an index out of range (nothing written past it). */
T256 int q4_rows8(const q4_layer *layer, const int64_t *ids, int64_t n, uint16_t *out) {
  int64_t k = layer->k, groups = k / GROUP;
  const int8_t *w = (const int8_t *)layer->w;
  for (int64_t r = 0; r < n; r++) {
    if (ids[r] < 0 || ids[r] >= layer->n) return -1;
    int64_t tile = ids[r] / TILE, j = ids[r] % TILE;
    for (int64_t g = 0; g < groups; g++) {
      float step = _cvtsh_ss(layer->d[(tile * groups + g) * TILE + j]);
      const int8_t *block = w + (tile * groups + g) * TILE_BYTES8 + 4 * j;
      uint16_t *row = out + r * k + g * GROUP;
      for (int u = 0; u < 8; u++)
        for (int i = 0; i < 4; i++) row[4 * u + i] = float_to_bf16((float)block[64 * u + i] * step);
    }
  }
  return 0;
}

/* A group's 32 4-bit values → its 16 bytes for output j of its tile's 256 (see the top). */
static inline void pack_group(const uint8_t *v, int64_t j, uint8_t *o) {
  for (int h = 0; h < 4; h++)
    for (int i = 0; i < 4; i++) o[64 * h + 4 * j + i] = (uint8_t)(v[8 * h + i] | (v[8 * h + 4 + i] << 4));
}

/* 4-bit q already quantized (N×K bytes, each in [0, 15]) → the layout's bytes, as q4_quantize
 * lays them out (the steps and minimums are placed by the caller). */
void q4_pack4(const uint8_t *q, int64_t n, int64_t k, uint8_t *out) {
  int64_t groups = k / GROUP;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < n; row++)
    for (int64_t g = 0; g < groups; g++)
      pack_group(q + row * k + g * GROUP, row % TILE, out + (row / TILE * groups + g) * TILE_BYTES);
}

/* The same from a GGUF file's 4-bit blocks as they lie (rows `row` bytes apart; models/gguf_blocks.py):
 * group g in block g / per of `block` bytes, its values from byte `head` on. Q4_0, Q4_1 (per 1):
 * value i in the low nibble of byte i, 16 + i in its high one. Q4_K (runs, per 8): groups 2c and
 * 2c + 1 in the low and the high nibbles of the 32 bytes from 32c on. */
void q4_pack_nibbles(const uint8_t *src, int64_t n, int64_t k, int64_t row, int64_t block, int64_t head, int runs,
                     uint8_t *out) {
  int64_t groups = k / GROUP, per = runs ? 8 : 1;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++)
    for (int64_t g = 0; g < groups; g++) {
      const uint8_t *b = src + r * row + g / per * block + head + (runs ? 32 * (g % per / 2) : 0);
      uint8_t v[GROUP];
      for (int i = 0; i < GROUP; i++)
        v[i] = runs ? (uint8_t)((b[i] >> (4 * (g % 2))) & 15) : (uint8_t)(i < 16 ? b[i] & 15 : b[i - 16] >> 4);
      pack_group(v, r % TILE, out + (r / TILE * groups + g) * TILE_BYTES);
    }
}

/* A GGUF file's fifth bits as its 5-bit blocks hold them (rows `row` bytes apart; models/gguf_blocks.py)
 * → the layout's (FIFTH_AT): group g in block g / per of `block` bytes, its bits from byte `at` on.
 * Q5_0, Q5_1 (per 1): value i's is bit i of a 32-bit word. Q5_K (runs, per 8): group g's value i's
 * is bit g of byte i of 32. A tile's rows at a time (their bits share the layout's bytes). */
void q4_pack_high(const uint8_t *src, int64_t n, int64_t k, int64_t row, int64_t block, int64_t at, int runs,
                  uint8_t *out) {
  int64_t groups = k / GROUP, per = runs ? 8 : 1;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n / TILE; t++)
    for (int64_t g = 0; g < groups; g++) {
      uint64_t words[8] = {0};
      for (int j = 0; j < TILE; j++) {
        const uint8_t *b = src + (t * TILE + j) * row + g / per * block + at;
        for (int v = 0; v < GROUP; v++) {
          uint64_t bit = runs ? (b[v] >> (g % per)) & 1 : (b[v / 8] >> (v % 8)) & 1;
          words[v / 4] |= bit << (4 * j + v % 4);
        }
      }
      memcpy(out + (t * groups + g) * 64, words, sizeof words);
    }
}
