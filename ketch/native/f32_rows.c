/* y = x @ W^T (+ bias) in fp32 for steps of a few rows: a batch-1 or small-batch decode step, a
 * speculative verify of k + 1 rows. W [N, K] row-major streams from memory once; every row of x
 * meets it from L1.
 *
 * Why not the BLAS: a few-row fp32 product is bound by W's bytes, and MKL's sgemm reads them at
 * full speed for 1-2 rows but at about half that from 4 rows on (30 layers of 3072x576: 6.8 ms
 * for 1 or 2 rows, 14 ms for 5, 18-21 ms for 8 on a 2-vCPU Sapphire Rapids), which is what an fp32
 * verify step of 5 rows paid.
 *
 * Numerics: each output is one fixed sequence of operations whatever the number of rows: per
 * vector lane, fp32 FMAs over K in order (a masked last vector when K is not a multiple of the
 * width), then the lanes summed in one fixed tree, then + bias. Rows never mix, so a row's
 * result is bit for bit the same in a batch of 1 or of 8 (a verify row equals the plain decode
 * row), on one machine and instruction set. */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define KETCH_ISA 3
#define LANES 16
#define XR 4 /* x rows per pass: 4 x WR accumulators + WR weight vectors + 1 of x in 32 registers */
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vload_tail(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { /* the lanes in one fixed tree: halves, then quarters, ... */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KETCH_ISA 2
#define LANES 8
#define XR 2 /* 16 registers: 2 x WR accumulators + WR weight vectors + 1 of x */
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vload_tail(const float *p, int n) {
    static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(ones + 8 - n)));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#else
#define KETCH_ISA 1 /* no vector loop: the caller keeps torch's product (f32_rows.py) */
#endif

int ketch_f32_rows_isa(void) { return KETCH_ISA; }

#if KETCH_ISA >= 2
#define WR 4  /* weight rows per tile */
#define PF 256 /* floats ahead (1 KB) each weight row is prefetched: without it 5 rows ran ~25 % slower */

/* rows x[0..R) (row stride ldx) against weight rows w[0..WR): out[i][j] = their dot product.
 * R is a constant at every call (the switch below), so the loops unroll into registers. */
static inline __attribute__((always_inline)) void dots(const float *x, int64_t ldx, const float *const w[WR],
                                                       int64_t K, int R, float out[XR][WR]) {
    vec acc[XR][WR];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < WR; j++) acc[i][j] = vzero();
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vec wv[WR];
        for (int j = 0; j < WR; j++) {
            _mm_prefetch((const char *)(w[j] + k + PF), _MM_HINT_T0);
            wv[j] = vload(w[j] + k);
        }
        for (int i = 0; i < R; i++) {
            const vec xv = vload(x + i * ldx + k);
            for (int j = 0; j < WR; j++) acc[i][j] = vfma(wv[j], xv, acc[i][j]);
        }
    }
    if (k < K) {
        const int n = (int)(K - k);
        vec wv[WR];
        for (int j = 0; j < WR; j++) wv[j] = vload_tail(w[j] + k, n);
        for (int i = 0; i < R; i++) {
            const vec xv = vload_tail(x + i * ldx + k, n);
            for (int j = 0; j < WR; j++) acc[i][j] = vfma(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < WR; j++) out[i][j] = vsum(acc[i][j]);
}

static void dots_any(const float *x, int64_t ldx, const float *const w[WR], int64_t K, int R, float out[XR][WR]) {
    switch (R) {
    case 1: dots(x, ldx, w, K, 1, out); break;
#if XR >= 2
    case 2: dots(x, ldx, w, K, 2, out); break;
#endif
#if XR >= 3
    case 3: dots(x, ldx, w, K, 3, out); break;
#endif
#if XR >= 4
    case 4: dots(x, ldx, w, K, 4, out); break;
#endif
    }
}
#endif

/* x [M, K] (row stride ldx), w [N, K] contiguous, bias [N] or NULL -> y [M, N] contiguous.
 * Threads split the weight's row tiles (static: each thread streams one contiguous range). */
void ketch_f32_rows_linear(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t M,
                           int64_t N, int64_t K, int threads) {
#if KETCH_ISA >= 2
    const int64_t tiles = (N + WR - 1) / WR;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t j0 = t * WR;
        const int live = (int)(N - j0 < WR ? N - j0 : WR);
        const float *wr[WR];
        for (int j = 0; j < WR; j++) wr[j] = w + (j0 + (j < live ? j : live - 1)) * K; /* a short last tile repeats its last row */
        for (int64_t i0 = 0; i0 < M; i0 += XR) {
            const int R = (int)(M - i0 < XR ? M - i0 : XR);
            float out[XR][WR];
            dots_any(x + i0 * ldx, ldx, wr, K, R, out);
            for (int i = 0; i < R; i++)
                for (int j = 0; j < live; j++) y[(i0 + i) * N + j0 + j] = bias ? out[i][j] + bias[j0 + j] : out[i][j];
        }
    }
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads;
#endif
}
