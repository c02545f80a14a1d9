/* Decode attention on the CPU: one query token per sequence over its K/V pages, read in place
 * from the paged pool (no gather of the context into a contiguous copy), threaded over
 * (sequence, query head).
 *
 * Why: torch's path gathered every sequence's pages per layer (two index_select copies) or, for
 * one sequence, took a view, then ran SDPA with an additive mask: ~30 us a layer at batch 1 for a
 * few hundred tokens, and at batch 32 copies of every context per layer.
 *
 * Numerics: bf16 q / K / V as stored, fp32 inside: s = (q . k) * scale, softmax over the
 * sequence's first `len` tokens (max subtracted), o = sum p v / sum p, rounded once to bf16.
 * Pool layout: [pages, page_size, kv_heads, dim]; query head h reads kv head h / (heads / kv_heads).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_common.h"

int ketch_attention_isa(void) { return KETCH_ISA; }

#if KETCH_ISA == 3
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

static inline float dot_row(const float *q, const uint16_t *k, int64_t dim) {
#if KETCH_ISA == 3
    if (dim % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load_bf16x16(k + d), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    for (int64_t d = 0; d < dim; d++) s += q[d] * bf16_to_f32(k[d]);
    return s;
}

#if KETCH_ISA == 3
/* e^x for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
 * (error ~r^7 / 7! < 2e-7 relative: within about one fp32 step), scaled by 2^n. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* scores[t] <- exp(scores[t] - top); returns their sum. */
static float exponentiate(float *scores, int64_t len, float top) {
    float total = 0.f;
    int64_t t = 0;
#if KETCH_ISA == 3
    __m512 sum = _mm512_setzero_ps();
    for (; t + 16 <= len; t += 16) {
        const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + t), _mm512_set1_ps(top)));
        _mm512_storeu_ps(scores + t, p);
        sum = _mm512_add_ps(sum, p);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; t < len; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    return total;
}

#if KETCH_ISA == 3
/* acc (NV x 16 floats) += sum_t p[t] v_t, the rows v_t in place in the pool; NV a constant where
 * inlined, so the accumulators stay in registers. */
static inline void weighted_rows(float *out, const float *p, const uint16_t *vpool, const int64_t *table,
                                 int64_t len, int64_t page_size, int64_t row, int64_t offset, const int nv) {
    __m512 acc[16];
    for (int c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *v = vpool + (table[t / page_size] * page_size + t % page_size) * row + offset;
        const __m512 pv = _mm512_set1_ps(p[t]);
        for (int c = 0; c < nv; c++) acc[c] = _mm512_fmadd_ps(pv, load_bf16x16(v + 16 * c), acc[c]);
    }
    for (int c = 0; c < nv; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}
#endif

/* out[d] = sum_t p[t] v_t[d] over the sequence's rows of one kv head. */
static void weighted_sum(float *out, const float *p, const uint16_t *vpool, const int64_t *table, int64_t len,
                         int64_t page_size, int64_t row, int64_t offset, int64_t dim) {
#if KETCH_ISA == 3
    switch (dim) { /* the common head sizes, unrolled */
    case 64: weighted_rows(out, p, vpool, table, len, page_size, row, offset, 4); return;
    case 128: weighted_rows(out, p, vpool, table, len, page_size, row, offset, 8); return;
    case 256: weighted_rows(out, p, vpool, table, len, page_size, row, offset, 16); return;
    default: break;
    }
#endif
    for (int64_t d = 0; d < dim; d++) out[d] = 0.f;
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *v = vpool + (table[t / page_size] * page_size + t % page_size) * row + offset;
        for (int64_t d = 0; d < dim; d++) out[d] += p[t] * bf16_to_f32(v[d]);
    }
}

/* q, out [B, heads, dim]; pages [B, page_stride] page ids; lens [B] tokens to attend to (>= 1).
 * Returns 0, or -1 when a scratch buffer cannot be allocated (out then undefined). */
int ketch_decode_attention_bf16(const uint16_t *q, const uint16_t *kpool, const uint16_t *vpool,
                                const int64_t *pages, int64_t page_stride, const int64_t *lens,
                                uint16_t *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t page_size, float scale, int nthreads) {
    const int64_t group = heads / kv_heads, row = kv_heads * dim;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < batch * heads; task++) {
        const int64_t b = task / heads, h = task % heads, kvh = h / group, len = lens[b];
        float *buf = malloc((size_t)(len + 2 * dim) * sizeof(float));
        if (buf == NULL) {
            failed = 1;
            continue;
        }
        float *scores = buf, *qf = buf + len, *acc = qf + dim;
        for (int64_t d = 0; d < dim; d++) qf[d] = bf16_to_f32(q[(b * heads + h) * dim + d]) * scale;
        const int64_t *table = pages + b * page_stride;
        float top = -INFINITY;
        for (int64_t t = 0; t < len; t++) {
            const int64_t slot = table[t / page_size] * page_size + t % page_size;
            scores[t] = dot_row(qf, kpool + slot * row + kvh * dim, dim);
            top = fmaxf(top, scores[t]);
        }
        const float total = exponentiate(scores, len, top);
        weighted_sum(acc, scores, vpool, table, len, page_size, row, kvh * dim, dim);
        for (int64_t d = 0; d < dim; d++) out[(b * heads + h) * dim + d] = f32_to_bf16(acc[d] / total);
        free(buf);
    }
    return failed ? -1 : 0;
}
