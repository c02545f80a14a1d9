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

static inline float dot_row(const float *q, const uint16_t *k, int64_t dim) {
#if KETCH_ISA == 3
    if (dim % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 kv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + d))), 16));
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), kv, acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    for (int64_t d = 0; d < dim; d++) s += q[d] * bf16_to_f32(k[d]);
    return s;
}

static inline void add_scaled_row(float *acc, float p, const uint16_t *v, int64_t dim) {
#if KETCH_ISA == 3
    if (dim % 16 == 0) {
        const __m512 pv = _mm512_set1_ps(p);
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 vv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + d))), 16));
            _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, vv, _mm512_loadu_ps(acc + d)));
        }
        return;
    }
#endif
    for (int64_t d = 0; d < dim; d++) acc[d] += p * bf16_to_f32(v[d]);
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
        for (int64_t d = 0; d < dim; d++) {
            qf[d] = bf16_to_f32(q[(b * heads + h) * dim + d]) * scale;
            acc[d] = 0.f;
        }
        const int64_t *table = pages + b * page_stride;
        float top = -INFINITY;
        for (int64_t t = 0; t < len; t++) {
            const int64_t slot = table[t / page_size] * page_size + t % page_size;
            scores[t] = dot_row(qf, kpool + slot * row + kvh * dim, dim);
            top = fmaxf(top, scores[t]);
        }
        float total = 0.f;
        for (int64_t t = 0; t < len; t++) {
            const float p = expf(scores[t] - top);
            total += p;
            const int64_t slot = table[t / page_size] * page_size + t % page_size;
            add_scaled_row(acc, p, vpool + slot * row + kvh * dim, dim);
        }
        for (int64_t d = 0; d < dim; d++) out[(b * heads + h) * dim + d] = f32_to_bf16(acc[d] / total);
        free(buf);
    }
    return failed ? -1 : 0;
}
