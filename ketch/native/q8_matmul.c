/* y = x @ W^T for W held as int8 blocks of 32 with one fp16 scale each (GGUF's Q8_0 form): the
 * batch-1 LM head of the CPU path, half the bytes of its bf16 matrix.
 *
 * Activations are rounded to int16 per block of 32 as for the 4-bit product (block_common.h),
 * and each block's dot product is exact in integers (`vpdpwssd` / `vpmaddwd`):
 *
 *     y[n] = sum_b  s[n,b] * d[b] * sum_i q[n,i] * qx[i]
 *
 * Layout (ketch/native/q8.py packs it): tiles of 16 rows, one per 32-bit lane; per tile and
 * block a record of 544 bytes: 8 runs of 64 bytes, in run r lane l's 4 bytes hold row 16t+l's
 * weights 4r, 4r+2, 4r+1, 4r+3 of the block (in that order: a 16-bit shift pair then gives the
 * sign-extended pairs (4r, 4r+1) and (4r+2, 4r+3) with no shuffle), then 16 fp16 scales.
 */
#include "block_common.h"

#define REC 544 /* bytes per (tile, block) record: 8 runs, 16 scales */

int ketch_q8_isa(void) { return KETCH_ISA; }

#if KETCH_ISA == 3
static void tile_product(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                         int64_t nb, int64_t K, int m, float *out) {
    (void)sx;
    __m512 acc[MAXM];
    for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * REC;
        prefetch_streams(wb, b, nb, REC);
        __m512i q[16]; /* q[2r]: pairs (4r, 4r+1), q[2r+1]: (4r+2, 4r+3), sign-extended int16 */
        for (int r = 0; r < 8; r++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wb + r * RUN));
            q[2 * r] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
            q[2 * r + 1] = _mm512_srai_epi16(v, 8);
        }
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 8 * RUN)));
        for (int i = 0; i < m; i++) {
            const int32_t *xp = (const int32_t *)(qx + i * K + b * BLK);
            const __m512 dot = block_dot(q, xp);
            acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sv, _mm512_set1_ps(dx[i * nb + b])), acc[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + i * TILE, acc[i]);
}
#elif KETCH_ISA == 2
static void tile_product(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                         int64_t nb, int64_t K, int m, float *out) {
    (void)sx;
    for (int h = 0; h < 2; h++) { /* lanes 0-7, then 8-15: each a half of every run */
        __m256 acc[MAXM];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = w + b * REC;
            if (h == 0) prefetch_streams(wb, b, nb, REC);
            __m256i q[16];
            for (int r = 0; r < 8; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + r * RUN + h * 32));
                q[2 * r] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
                q[2 * r + 1] = _mm256_srai_epi16(v, 8);
            }
            const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + 8 * RUN + h * 16)));
            for (int i = 0; i < m; i++) {
                const int32_t *xp = (const int32_t *)(qx + i * K + b * BLK);
                const __m256 dot = block_dot(q, xp);
                acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sv, _mm256_set1_ps(dx[i * nb + b])), acc[i]);
            }
        }
        for (int i = 0; i < m; i++) _mm256_storeu_ps(out + i * TILE + h * 8, acc[i]);
    }
}
#else
static void tile_product(const uint8_t *w, const int16_t *qx, const float *dx, const float *sx,
                         int64_t nb, int64_t K, int m, float *out) {
    (void)sx;
    static const int order[4] = {0, 2, 1, 3}; /* byte p of a run's word holds weight 4r + order[p] */
    for (int i = 0; i < m; i++) {
        for (int l = 0; l < TILE; l++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + b * REC;
                const int16_t *xb = qx + i * K + b * BLK;
                int32_t dot = 0;
                for (int r = 0; r < 8; r++)
                    for (int p = 0; p < 4; p++)
                        dot += (int32_t)(int8_t)wb[r * RUN + l * 4 + p] * xb[4 * r + order[p]];
                acc = fmaf((float)dot, f16_to_f32(((const uint16_t *)(wb + 8 * RUN))[l]) * dx[i * nb + b], acc);
            }
            out[i * TILE + l] = acc;
        }
    }
}
#endif

/* x [M, K] (bf16 when `bf16`, else fp32) times the packed [N, K] weight into y [M, N]. */
int ketch_q8_matmul(const uint8_t *w, const void *x, void *y, int bf16, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
    return block_matmul(tile_product, quantize_row, NULL, REC, w, x, y, bf16, M, N, K, nthreads);
}
