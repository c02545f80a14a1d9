/* What ketch's block-quantized products share (q4_matmul.c, q8_matmul.c): the instruction set,
 * bf16 / fp16 conversions, the rounding of activations to int16 per block of 32, and the driver
 * that quantizes x once and runs a tile kernel over the weight's tiles on OpenMP threads.
 * Weights sit in tiles of 16 output rows, one row per 32-bit lane, each tile's blocks one
 * sequential stream of records. */
#ifndef KETCH_BLOCK_COMMON_H
#define KETCH_BLOCK_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define KETCH_ISA 3
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KETCH_ISA 2
#else
#define KETCH_ISA 1
#endif

#define TILE 16   /* output rows per tile */
#define BLK 32    /* weights per block */
#define RUN 64    /* bytes per run: 16 lanes x 4 bytes */
#define MAXM 8    /* activation rows sharing one decode of a block's weights (8: 5-10 % faster than 4 at 32+ rows on AVX2 and AVX-512, docs/performance.md) */
#define AHEAD 8   /* records prefetched ahead of the one being read */
#define QMAX 32767.f /* activations round to int16 in [-QMAX, QMAX] */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) { /* exact; the generic path only */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        f = (float)man * 5.9604644775390625e-8f;
        uint32_t u;
        memcpy(&u, &f, 4);
        u |= sign;
        memcpy(&f, &u, 4);
        return f;
    }
    const uint32_t u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    memcpy(&f, &u, 4);
    return f;
}

/* One row of x: per block of 32, int16 values q = round(x / d) with d = max |x| / 32767, d,
 * and the block's fp32 sum. */
static void quantize_row(const void *x, int bf16, int64_t K, int16_t *qx, float *dx, float *sx) {
    for (int64_t b = 0; b < K / BLK; b++) {
#if KETCH_ISA == 3
        __m512 v[2];
        for (int h = 0; h < 2; h++)
            v[h] = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + b * BLK + 16 * h))), 16))
                        : _mm512_loadu_ps((const float *)x + b * BLK + 16 * h);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? QMAX / amax : 0.f);
        for (int h = 0; h < 2; h++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v[h], inv),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm256_storeu_si256((__m256i *)(qx + b * BLK + 16 * h), _mm512_cvtsepi32_epi16(q));
        }
#else
        float v[BLK], amax = 0.f, sum = 0.f;
        for (int i = 0; i < BLK; i++) {
            v[i] = bf16 ? bf16_to_f32(((const uint16_t *)x)[b * BLK + i]) : ((const float *)x)[b * BLK + i];
            sum += v[i];
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float inv = amax > 0.f ? QMAX / amax : 0.f;
        for (int i = 0; i < BLK; i++) qx[b * BLK + i] = (int16_t)nearbyintf(v[i] * inv);
#endif
        dx[b] = amax / QMAX;
        sx[b] = sum;
    }
}

static inline void prefetch_record(const uint8_t *r, int bytes) {
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch(r + line, 0, 3);
}

/* Before reading record b of a tile (records of `rec` bytes, nb a tile): prefetch this tile's
 * record b + AHEAD and the next tile's record b. One sequential stream per thread kept too few
 * cache-line fills in flight: a batch-1 product read its weights from memory at ~12 GB/s a core
 * against ~16-20 for several streams; the next tile's records, fetched while this tile runs,
 * make it two streams (~+30 % from memory, docs/performance.md). The last tile of a range
 * prefetches one tile past it: a hint, never a fault. */
static inline void prefetch_streams(const uint8_t *wb, int64_t b, int64_t nb, int rec) {
    if (b + AHEAD < nb) prefetch_record(wb + AHEAD * rec, rec);
    prefetch_record(wb + nb * rec, rec);
}

/* Sum of a block's 16 weight pairs (q[j]: per lane, weights 2j and 2j+1 as two int16) times the
 * activation pairs xp[j], exact in int32, as fp32 lanes. */
#if KETCH_ISA == 3
static inline __m512 block_dot(const __m512i q[16], const int32_t *xp) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int j = 0; j < 16; j += 2) {
        even = _mm512_dpwssd_epi32(even, q[j], _mm512_set1_epi32(xp[j]));
        odd = _mm512_dpwssd_epi32(odd, q[j + 1], _mm512_set1_epi32(xp[j + 1]));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
}
#elif KETCH_ISA == 2
static inline __m256 block_dot(const __m256i q[16], const int32_t *xp) {
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int j = 0; j < 16; j += 2) { /* |q| <= 127, |x| <= 32767: a pair's sum fits int32 */
        even = _mm256_add_epi32(even, _mm256_madd_epi16(q[j], _mm256_set1_epi32(xp[j])));
        odd = _mm256_add_epi32(odd, _mm256_madd_epi16(q[j + 1], _mm256_set1_epi32(xp[j + 1])));
    }
    return _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
}
#endif

/* One tile's product: w the tile's records, qx / dx / sx m rows' quantized activations. */
typedef void (*tile_fn)(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                        int64_t nb, int64_t K, int m, float *out);

/* Rounds one row of x (bf16 when `bf16`, else fp32) into the activations the tile kernel reads:
 * quantize_row's int16 values, or an opt-in narrower form (q4_matmul.c's int8), in the row's
 * K * 2 bytes of scratch, and per block its scale d and exact fp32 sum. */
typedef void (*row_quant_fn)(const void *x, int bf16, int64_t K, int16_t *qx, float *dx, float *sx);

/* Rewrites a row's K quantized activations in place into the form its product's tile kernel
 * reads (the same K * 2 bytes); NULL: the tile reads the int16 values as they are. */
typedef void (*row_prep_fn)(int16_t *qx, int64_t K);

/* x [M, K] (bf16 when `bf16`, else fp32) times a packed [N, K] weight (records of `rec` bytes per
 * tile and block) into y [M, N] (same dtype). Returns 0, or -1 when the scratch cannot be
 * allocated (y untouched). */
static int block_matmul(tile_fn tile, row_quant_fn quant, row_prep_fn prep, int64_t rec, const uint8_t *w,
                        const void *x, void *y, int bf16, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nb = K / BLK, tiles = (N + TILE - 1) / TILE;
    int16_t *qx = malloc((size_t)(M * K * (int64_t)sizeof(int16_t) + 2 * M * nb * (int64_t)sizeof(float)));
    if (qx == NULL) return -1;
    float *dx = (float *)(qx + M * K), *sx = dx + M * nb;
    const size_t elt = bf16 ? 2 : 4;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            quant((const char *)x + i * K * elt, bf16, K, qx + i * K, dx + i * nb, sx + i * nb);
            if (prep != NULL) prep(qx + i * K, K);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            float out[MAXM * TILE];
            for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
                const int m = M - m0 < MAXM ? (int)(M - m0) : MAXM;
                tile(w + t * nb * rec, qx + m0 * K, dx + m0 * nb, sx + m0 * nb, nb, K, m, out);
                for (int i = 0; i < m; i++)
                    for (int l = 0; l < TILE && t * TILE + l < N; l++) {
                        const int64_t at = (m0 + i) * N + t * TILE + l;
                        if (bf16) ((uint16_t *)y)[at] = f32_to_bf16(out[i * TILE + l]);
                        else ((float *)y)[at] = out[i * TILE + l];
                    }
            }
        }
    }
    free(qx);
    return 0;
}

#endif
