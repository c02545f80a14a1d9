/* y = x @ W^T for W held as 4-bit blocks: the decode-sized product of the CPU path.
 *
 * Why: at batch 1 a CPU decode step streams every weight once, and torch's int4 kernel spent
 * ~42 us a call on this model's small matrices (5 ms of a 12.8 ms step). Here each row of x is
 * rounded to int16 per block of 32 (scale = max |x| / 32767: finer than x's own bf16 for every
 * value within 2^7 of its block's largest; the block's exact fp32 sum kept beside it) and each
 * block's product is an exact integer dot product of the 4-bit weights with those int16 values
 * (AVX512-VNNI `vpdpbusd` on the activations' two bytes, or AVX2 `vpmaddwd`), scaled once per block in fp32:
 *
 *     y[n] = sum_b  s[n,b] * d[b] * sum_i q[n,i] * qx[i]   +   z[n,b] * sum_i x[i]
 *
 * for weights w = q * s + z (q in 0..15). (int8 activations, as llama.cpp rounds them, were
 * tried first: ~1.6x less arithmetic, but on SmolLM2 the greedy tokens agreed with fp32 for 13.8
 * of 32 on average, against 22.1 with bf16 activations; its activations have outliers.) Every
 * row of x is rounded and reduced on its own, in the same order whatever the batch: a row's
 * result does not depend on the rows beside it.
 *
 * Layout (ketch/native/q4.py packs it): rows in tiles of 16, one per 32-bit lane; a tile's blocks
 * follow each other, each a record of 320 bytes, so a tile is one sequential stream:
 *   4 runs of 64 bytes: in run r, lane l's 32 bits hold row 16t+l's weights 8r..8r+7 of the
 *     block, weight 8r+2k in bits 4k..4k+3 and 8r+2k+1 in bits 16+4k..16+4k+3; so a shift by 4k
 *     and a mask leave, per lane, the pair of 16-bit weights that one `vpmaddwd` multiplies with
 *     a broadcast pair of activations: no shuffles;
 *   16 fp16 scales, 16 fp16 zeros (GGUF's own fp16 values: q4.py packs only what fp16 holds).
 */
#include "block_common.h"

#define REC 320 /* bytes per (tile, block) record: 4 runs, 16 scales, 16 zeros */

int ketch_q4_isa(void) { return KETCH_ISA; }

/* A run's 32-bit word masked with 0x0F0F0F0F holds, as bytes, its row's weights (8r, 8r+4, 8r+1,
 * 8r+5) of the layout above, and shifted right by 4 first (8r+2, 8r+6, 8r+3, 8r+7): the order in
 * which the byte products (`vpdpbusd`, `vpmaddubsw`) pair a row's weights with the activations. */
#if KETCH_ISA >= 2
static const int PLANE_ORDER[8] = {0, 4, 1, 5, 2, 6, 3, 7};
#endif

#if KETCH_ISA == 3
/* AVX512-VNNI: the block's integer dot product with `vpdpbusd` (u8 x s8, 64 multiply-adds an
 * instruction) on the activations' two bytes, x = 256 xh + xl (xh = x >> 8 signed, xl = x & 255
 * unsigned):  sum q x = 256 * sum q xh  +  sum xl q,  the first with q as the unsigned operand, the
 * second with q as the signed one (q in 0..15 is both). Exact, so bit for bit the `vpdpwssd` sum
 * of int16 pairs it replaces; but a run's nibbles come out as bytes with one mask and one shift
 * instead of one mask and up to two shifts per pair: ~42 instructions a block instead of ~70 at
 * one row (a weight hot in L2: 25 -> 32 GB/s a core; from memory it pays once prefetch_streams
 * brings the records fast enough).
 *
 * `byte_planes` orders each row's activation bytes as PLANE_ORDER pairs them, once per call. */
/* In place (block_matmul's row_prep_fn): per block of 32, the 32 high bytes then the 32 low bytes,
 * dword 2r + h holding activations PLANE_ORDER[4h .. 4h + 3] + 8r of the block. */
static void byte_planes(int16_t *qx, int64_t K) {
    for (int64_t b = 0; b < K / BLK; b++) {
        int16_t v[BLK];
        memcpy(v, qx + b * BLK, sizeof v);
        int8_t *hi = (int8_t *)(qx + b * BLK);
        uint8_t *lo = (uint8_t *)hi + BLK;
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 8; j++) {
                const int16_t x = v[8 * r + PLANE_ORDER[j]];
                hi[8 * r + j] = (int8_t)(x >> 8); /* arithmetic: x = 256 hi + lo */
                lo[8 * r + j] = (uint8_t)(x & 0xff);
            }
    }
}

/* The tile over the records; per row and block the integer sum of the int16 activations' two
 * byte planes (byte_planes), or, `int8` (ketch_q4_matmul_i8, a constant where inlined), of the
 * int8 activations in one `vpdpbusd` per 4 weights. */
static inline void vnni_tile(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx, int64_t nb,
                             int64_t K, int m, float *out, const int int8) {
    __m512 acc[MAXM], accz[MAXM];
    for (int i = 0; i < m; i++) acc[i] = accz[i] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * REC;
        prefetch_streams(wb, b, nb, REC);
        __m512i q[8]; /* q[2r + h]: per lane, 4 weights as bytes (PLANE_ORDER) */
        for (int r = 0; r < 4; r++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wb + r * RUN));
            q[2 * r] = _mm512_and_si512(v, nibble);
            q[2 * r + 1] = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
        }
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 4 * RUN)));
        const __m512 zv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 4 * RUN + 32)));
        for (int i = 0; i < m; i++) {
            __m512i sum = _mm512_setzero_si512();
            if (int8) {
                const int32_t *xp = (const int32_t *)((const int8_t *)(qx + i * K) + b * BLK);
                for (int j = 0; j < 8; j++) sum = _mm512_dpbusd_epi32(sum, q[j], _mm512_set1_epi32(xp[j]));
            } else {
                const int32_t *hi = (const int32_t *)(qx + i * K + b * BLK), *lo = hi + 8;
                __m512i sh = _mm512_setzero_si512();
                for (int j = 0; j < 8; j++) {
                    sh = _mm512_dpbusd_epi32(sh, q[j], _mm512_set1_epi32(hi[j]));
                    sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi32(lo[j]), q[j]);
                }
                sum = _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sum);
            }
            const __m512 dot = _mm512_cvtepi32_ps(sum);
            acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sv, _mm512_set1_ps(dx[i * nb + b])), acc[i]);
            accz[i] = _mm512_fmadd_ps(zv, _mm512_set1_ps(sx[i * nb + b]), accz[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + i * TILE, _mm512_add_ps(acc[i], accz[i]));
}

static void tile_product(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                         int64_t nb, int64_t K, int m, float *out) {
    vnni_tile(w, qx, dx, sx, nb, K, m, out, 0);
}
#define ROW_PREP byte_planes
#elif KETCH_ISA == 2
/* One row of x (a batch-1 decode step): both halves of the tile in one pass over its blocks, so
 * each activation pair is broadcast once for the 16 rows instead of once per 8. With one row
 * nothing amortizes the weight decoding, and the general loop below spent ~176 instructions a
 * block where this takes ~115. The same integer sums (exact) and the same fp32 operations in the
 * same order as the general loop: its result bit for bit. */
static void tile_product_one_row(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                                 int64_t nb, float *out) {
    const __m256i pair = _mm256_set1_epi32(0x000F000F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, accz0 = acc0, accz1 = acc0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * REC;
        prefetch_streams(wb, b, nb, REC);
        const int32_t *xp = (const int32_t *)(qx + b * BLK); /* activation pairs */
        __m256i even0 = _mm256_setzero_si256(), odd0 = even0, even1 = even0, odd1 = even0;
        for (int r = 0; r < 4; r++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wb + r * RUN));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wb + r * RUN + 32));
            for (int k = 0; k < 4; k += 2) { /* pair 4r + k is even, 4r + k + 1 odd, as in block_dot */
                const __m256i xe = _mm256_set1_epi32(xp[4 * r + k]), xo = _mm256_set1_epi32(xp[4 * r + k + 1]);
                even0 = _mm256_add_epi32(even0, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi32(v0, 4 * k), pair), xe));
                even1 = _mm256_add_epi32(even1, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi32(v1, 4 * k), pair), xe));
                odd0 = _mm256_add_epi32(odd0, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi32(v0, 4 * k + 4), pair), xo));
                odd1 = _mm256_add_epi32(odd1, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi32(v1, 4 * k + 4), pair), xo));
            }
        }
        const __m256 d = _mm256_set1_ps(dx[b]), z = _mm256_set1_ps(sx[b]);
        const __m256 sv0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN)));
        const __m256 sv1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 16)));
        const __m256 zv0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 32)));
        const __m256 zv1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 48)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(even0, odd0)), _mm256_mul_ps(sv0, d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(even1, odd1)), _mm256_mul_ps(sv1, d), acc1);
        accz0 = _mm256_fmadd_ps(zv0, z, accz0);
        accz1 = _mm256_fmadd_ps(zv1, z, accz1);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc0, accz0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(acc1, accz1));
}

static void tile_product(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                         int64_t nb, int64_t K, int m, float *out) {
    if (m == 1) {
        tile_product_one_row(w, qx, dx, sx, nb, out);
        return;
    }
    const __m256i pair = _mm256_set1_epi32(0x000F000F);
    for (int h = 0; h < 2; h++) { /* lanes 0-7, then 8-15: each a half of every run */
        __m256 acc[MAXM], accz[MAXM];
        for (int i = 0; i < m; i++) acc[i] = accz[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = w + b * REC;
            if (h == 0) prefetch_streams(wb, b, nb, REC);
            __m256i q[16];
            for (int r = 0; r < 4; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + r * RUN + h * 32));
                q[4 * r] = _mm256_and_si256(v, pair);
                for (int k = 1; k < 4; k++) q[4 * r + k] = _mm256_and_si256(_mm256_srli_epi32(v, 4 * k), pair);
            }
            const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + h * 16)));
            const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 32 + h * 16)));
            for (int i = 0; i < m; i++) {
                const int32_t *xp = (const int32_t *)(qx + i * K + b * BLK);
                const __m256 dot = block_dot(q, xp);
                acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sv, _mm256_set1_ps(dx[i * nb + b])), acc[i]);
                accz[i] = _mm256_fmadd_ps(zv, _mm256_set1_ps(sx[i * nb + b]), accz[i]);
            }
        }
        for (int i = 0; i < m; i++) _mm256_storeu_ps(out + i * TILE + h * 8, _mm256_add_ps(acc[i], accz[i]));
    }
}
#else
/* Plain C (no AVX2): each lane's block dot product from the record's words, the activations int16
 * or, for ketch_q4_matmul_i8, int8 in their natural order, in a row's int16 scratch. */
static void generic_tile(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx, int64_t nb, int64_t K,
                         int m, float *out, int int8) {
    for (int i = 0; i < m; i++) {
        for (int l = 0; l < TILE; l++) {
            float acc = 0.f, accz = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + b * REC;
                const uint16_t *sz = (const uint16_t *)(wb + 4 * RUN);
                const int16_t *x16 = qx + i * K + b * BLK;
                const int8_t *x8 = (const int8_t *)(qx + i * K) + b * BLK;
                int32_t dot = 0;
                for (int r = 0; r < 4; r++) {
                    uint32_t word;
                    memcpy(&word, wb + r * RUN + l * 4, 4);
                    for (int k = 0; k < 4; k++) {
                        const int j = 8 * r + 2 * k;
                        dot += (int32_t)((word >> (4 * k)) & 15) * (int8 ? x8[j] : x16[j])
                             + (int32_t)((word >> (16 + 4 * k)) & 15) * (int8 ? x8[j + 1] : x16[j + 1]);
                    }
                }
                acc = fmaf((float)dot, f16_to_f32(sz[l]) * dx[i * nb + b], acc);
                accz = fmaf(f16_to_f32(sz[TILE + l]), sx[i * nb + b], accz);
            }
            out[i * TILE + l] = acc + accz;
        }
    }
}

static void tile_product(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                         int64_t nb, int64_t K, int m, float *out) {
    generic_tile(w, qx, dx, sx, nb, K, m, out, 0);
}
#endif

#ifndef ROW_PREP
#define ROW_PREP NULL /* the other instruction sets read the int16 activations as they are */
#endif

/* x [M, K] (bf16 when `bf16`, else fp32) times the packed [N, K] weight into y [M, N]. */
int ketch_q4_matmul(const uint8_t *w, const void *x, void *y, int bf16, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
    return block_matmul(tile_product, quantize_row, ROW_PREP, REC, w, x, y, bf16, M, N, K, nthreads);
}

/* ---- int8 activations (`ketch_q4_matmul_i8`; opt-in, `--cpu-activations int8`) ----
 *
 * llama.cpp's rounding of the activations: d = max |x| / 127 per block of 32, so each block's
 * product is bytes times bytes, u8 weights (0..15) x s8 activations: one `vpdpbusd` (AVX512-VNNI)
 * or `vpmaddubsw` (AVX2) per 4 weights a row, where int16 activations need two (the activation's
 * two bytes) or a `vpmaddwd` + `vpaddd` per 2. About 1.9x fewer instructions; the price is
 * fidelity: on SmolLM2, whose activations have outliers, greedy tokens agreed with fp32 for 13.8 of
 * 32 on average against 21.5 with int16 (docs/performance.md). The block's sum stays the exact
 * fp32 sum of x (llama.cpp keeps d * sum(q)), the weights and their layout are the same records.
 * Rows are rounded and reduced on their own as in the int16 path: batch-invariant. */

/* One row: per block, the 32 int8 values in the order the tile kernel pairs them with the weight
 * bytes (ISA 2 and 3: byte 8r + j of the block is x[8r + PLANE_ORDER[j]]; generic: natural
 * order), in the first K bytes of the row's int16 scratch. */
static void quantize_row_i8(const void *x, int bf16, int64_t K, int16_t *scratch, float *dx, float *sx) {
    int8_t *qx = (int8_t *)scratch;
    for (int64_t b = 0; b < K / BLK; b++) {
        float v[BLK], amax = 0.f, sum = 0.f;
        for (int i = 0; i < BLK; i++) {
            v[i] = bf16 ? bf16_to_f32(((const uint16_t *)x)[b * BLK + i]) : ((const float *)x)[b * BLK + i];
            sum += v[i];
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t *q = qx + b * BLK;
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 8; j++) {
#if KETCH_ISA >= 2
                const int from = 8 * r + PLANE_ORDER[j];
#else
                const int from = 8 * r + j;
#endif
                q[8 * r + j] = (int8_t)nearbyintf(v[from] * inv);
            }
        dx[b] = amax / 127.f;
        sx[b] = sum;
    }
}

#if KETCH_ISA == 3
static void tile_product_i8(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                            int64_t nb, int64_t K, int m, float *out) {
    vnni_tile(w, qx, dx, sx, nb, K, m, out, 1);
}
#elif KETCH_ISA == 2
/* A block's 8 byte-quad products for 8 rows, summed in int16 (each `vpmaddubsw` pair is at most
 * 2 * 15 * 127 = 3810, so 8 of them stay below 32767) and widened once. */
static inline __m256 block_dot_i8(const __m256i q[8], const int32_t *xp) {
    __m256i s = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(xp[0]));
    for (int j = 1; j < 8; j++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[j], _mm256_set1_epi32(xp[j])));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s, _mm256_set1_epi16(1)));
}

/* The weights of lanes 8h..8h+7 of a block's record as bytes, PLANE_ORDER quads per run. */
static inline void decode_half_i8(const uint8_t *wb, int h, __m256i q[8]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < 4; r++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + r * RUN + h * 32));
        q[2 * r] = _mm256_and_si256(v, nibble);
        q[2 * r + 1] = _mm256_and_si256(_mm256_srli_epi32(v, 4), nibble);
    }
}

static void tile_product_i8(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                            int64_t nb, int64_t K, int m, float *out) {
    if (m == 1) { /* both halves in one pass over the records: each record read once */
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, accz0 = acc0, accz1 = acc0;
        const int8_t *x8 = (const int8_t *)qx;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = w + b * REC;
            prefetch_streams(wb, b, nb, REC);
            const int32_t *xp = (const int32_t *)(x8 + b * BLK);
            __m256i q0[8], q1[8];
            decode_half_i8(wb, 0, q0);
            decode_half_i8(wb, 1, q1);
            const __m256 d = _mm256_set1_ps(dx[b]), z = _mm256_set1_ps(sx[b]);
            const __m256 sv0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN)));
            const __m256 sv1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 16)));
            const __m256 zv0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 32)));
            const __m256 zv1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 48)));
            acc0 = _mm256_fmadd_ps(block_dot_i8(q0, xp), _mm256_mul_ps(sv0, d), acc0);
            acc1 = _mm256_fmadd_ps(block_dot_i8(q1, xp), _mm256_mul_ps(sv1, d), acc1);
            accz0 = _mm256_fmadd_ps(zv0, z, accz0);
            accz1 = _mm256_fmadd_ps(zv1, z, accz1);
        }
        _mm256_storeu_ps(out, _mm256_add_ps(acc0, accz0));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(acc1, accz1));
        return;
    }
    for (int h = 0; h < 2; h++) { /* lanes 0-7, then 8-15 */
        __m256 acc[MAXM], accz[MAXM];
        for (int i = 0; i < m; i++) acc[i] = accz[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = w + b * REC;
            if (h == 0) prefetch_streams(wb, b, nb, REC);
            __m256i q[8];
            decode_half_i8(wb, h, q);
            const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + h * 16)));
            const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 4 * RUN + 32 + h * 16)));
            for (int i = 0; i < m; i++) {
                const int32_t *xp = (const int32_t *)((const int8_t *)(qx + i * K) + b * BLK);
                acc[i] = _mm256_fmadd_ps(block_dot_i8(q, xp), _mm256_mul_ps(sv, _mm256_set1_ps(dx[i * nb + b])), acc[i]);
                accz[i] = _mm256_fmadd_ps(zv, _mm256_set1_ps(sx[i * nb + b]), accz[i]);
            }
        }
        for (int i = 0; i < m; i++) _mm256_storeu_ps(out + i * TILE + h * 8, _mm256_add_ps(acc[i], accz[i]));
    }
}
#else
static void tile_product_i8(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                            int64_t nb, int64_t K, int m, float *out) {
    generic_tile(w, qx, dx, sx, nb, K, m, out, 1);
}
#endif

/* As ketch_q4_matmul, the activations rounded to int8 (above). */
int ketch_q4_matmul_i8(const uint8_t *w, const void *x, void *y, int bf16, int64_t M, int64_t N, int64_t K,
                       int nthreads) {
    return block_matmul(tile_product_i8, quantize_row_i8, NULL, REC, w, x, y, bf16, M, N, K, nthreads);
}
