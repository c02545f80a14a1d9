/* Decode attention on the CPU: one query token per sequence over its K/V pages, read in place
 * from the paged pool (no gather of the context into a contiguous copy), threaded over sequences
 * (at least two a thread: all heads of a sequence in one task, reading its rows whole in chunks,
 * the next chunk prefetched), else over (sequence, GQA group of query heads), or (sequence, query
 * head) when that is too few tasks.
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

/* One vector of W floats: AVX-512 (16) or AVX2 (8); the loops below are written once over it. */
#if KETCH_ISA == 3
#define W 16
typedef __m512 vf;
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p * 2^n */
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif KETCH_ISA == 2
#define W 8
typedef __m256 vf;
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) { /* n integral in [-126, 0] here: 2^n built in the exponent field */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* The sums of eight vectors as one: lane r = the sum of a[r]'s lanes (three rounds of pairwise
 * adds; one horizontal sum per score would cost about as much as the score's own FMAs). */
static inline vf vsum8(const vf a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    /* lo: a0..a3's sums over their low 128 bits, then over their high 128 bits; hi: the same for a4..a7 */
    const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif

static inline float dot_row(const float *q, const uint16_t *k, int64_t dim) {
#ifdef W
    if (dim % W == 0) {
        vf acc = vset1(0.f);
        for (int64_t d = 0; d < dim; d += W) acc = vfmadd(vload(q + d), vload_bf16(k + d), acc);
        return vsum(acc);
    }
#endif
    float s = 0.f;
    for (int64_t d = 0; d < dim; d++) s += q[d] * bf16_to_f32(k[d]);
    return s;
}

/* Element offsets of the sequence's first `len` rows (of the kv head at `offset`) in the pool,
 * page by page: no division per row (with the page size a run-time value, a division per row
 * and head cost more than the row's arithmetic). */
static void row_offsets(int64_t *off, const int64_t *table, int64_t len, int64_t page_size, int64_t row,
                        int64_t offset) {
    for (int64_t t0 = 0, i = 0; t0 < len; t0 += page_size, i++) {
        const int64_t base = table[i] * page_size * row + offset, n = len - t0 < page_size ? len - t0 : page_size;
        for (int64_t j = 0; j < n; j++) off[t0 + j] = base + j * row;
    }
}

/* scores[t] = q . k_t for the rows at `off`. */
static void score_rows(float *scores, const float *qf, const uint16_t *kpool, const int64_t *off, int64_t len,
                       int64_t dim) {
    int64_t t = 0;
#if KETCH_ISA == 2
    if (dim % W == 0) /* eight rows at a time, reduced together */
        for (; t + 8 <= len; t += 8) {
            vf acc[8];
            for (int r = 0; r < 8; r++) acc[r] = vset1(0.f);
            for (int64_t d = 0; d < dim; d += W) {
                const vf qv = vload(qf + d);
                for (int r = 0; r < 8; r++) acc[r] = vfmadd(qv, vload_bf16(kpool + off[t + r] + d), acc[r]);
            }
            vstore(scores + t, vsum8(acc));
        }
#endif
    for (; t < len; t++) scores[t] = dot_row(qf, kpool + off[t], dim);
}

#ifdef W
/* e^x for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
 * (error ~r^7 / 7! < 2e-7 relative: within about one fp32 step), scaled by 2^n. x is clamped at
 * -87 (e^-87 ~ 1.6e-38, fp32's smallest normals), so n >= -126 and 2^n is a normal number. */
static inline vf exp_nonpositive(vf x) {
    x = vmax(x, vset1(-87.f));
    const vf n = vround(vmul(x, vset1(1.44269504f)));
    vf r = vfnmadd(n, vset1(0.693145752f), x);
    r = vfnmadd(n, vset1(1.42860677e-6f), r);
    vf p = vset1(1.f / 720);
    p = vfmadd(p, r, vset1(1.f / 120));
    p = vfmadd(p, r, vset1(1.f / 24));
    p = vfmadd(p, r, vset1(1.f / 6));
    p = vfmadd(p, r, vset1(0.5f));
    p = vfmadd(p, r, vset1(1.f));
    p = vfmadd(p, r, vset1(1.f));
    return vscale2(p, n);
}
#endif

/* scores[t] <- exp(scores[t] - top); returns their sum. */
static float exponentiate(float *scores, int64_t len, float top) {
    float total = 0.f;
    int64_t t = 0;
#ifdef W
    vf sum = vset1(0.f);
    for (; t + W <= len; t += W) {
        const vf p = exp_nonpositive(vsub(vload(scores + t), vset1(top)));
        vstore(scores + t, p);
        sum = vadd(sum, p);
    }
    total = vsum(sum);
#endif
    for (; t < len; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    return total;
}

#ifdef W
/* acc (NV x W floats) += sum_t p[t] v_t, the rows v_t in place in the pool; NV a constant where
 * inlined, so the accumulators stay in registers (AVX2 at dim 256 spills some: still vector). */
static inline void weighted_rows(float *out, const float *p, const uint16_t *vpool, const int64_t *off, int64_t len,
                                 const int nv, const int from_out) {
    vf acc[32];
    for (int c = 0; c < nv; c++) acc[c] = from_out ? vload(out + W * c) : vset1(0.f);
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *v = vpool + off[t];
        const vf pv = vset1(p[t]);
        for (int c = 0; c < nv; c++) acc[c] = vfmadd(pv, vload_bf16(v + W * c), acc[c]);
    }
    for (int c = 0; c < nv; c++) vstore(out + W * c, acc[c]);
}
#endif

/* out[d] = sum_t p[t] v_t[d] over the rows at `off`; `more`: added to out's values instead, the
 * same FMAs in the same order as one pass over all the rows (attend_sequence's chunks). */
static void weighted_sum(float *out, const float *p, const uint16_t *vpool, const int64_t *off, int64_t len,
                         int64_t dim, int more) {
#ifdef W
    switch (dim) { /* the common head sizes, unrolled */
    case 64: weighted_rows(out, p, vpool, off, len, 64 / W, more); return;
    case 128: weighted_rows(out, p, vpool, off, len, 128 / W, more); return;
    case 256: weighted_rows(out, p, vpool, off, len, 256 / W, more); return;
    default: break;
    }
#endif
    if (!more)
        for (int64_t d = 0; d < dim; d++) out[d] = 0.f;
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *v = vpool + off[t];
        for (int64_t d = 0; d < dim; d++) out[d] += p[t] * bf16_to_f32(v[d]);
    }
}

#ifdef W
/* dot_row's vector branch over a row already in fp32: the same operations, so the same bits. */
static inline float dot_f32(const float *q, const float *k, int64_t dim) {
    vf acc = vset1(0.f);
    for (int64_t d = 0; d < dim; d += W) acc = vfmadd(vload(q + d), vload(k + d), acc);
    return vsum(acc);
}
#endif

/* scores[g * len + t] = q_g . k_t for `per` query heads of one kv head: each K row is read and
 * widened to fp32 once (into `kf`, 8 rows of `dim`) for all of them, and each head's score is
 * computed with score_rows' own operations in its order, so the same bits as one head at a time. */
static void score_rows_group(float *scores, int64_t stride, const float *qf, int64_t per, const uint16_t *kpool,
                             const int64_t *off, int64_t len, int64_t dim, float *kf) {
#ifdef W
    if (per > 1 && dim % W == 0) {
        int64_t t = 0;
#if KETCH_ISA == 2
        for (; t + 8 <= len; t += 8) {
            for (int r = 0; r < 8; r++)
                for (int64_t d = 0; d < dim; d += W) vstore(kf + r * dim + d, vload_bf16(kpool + off[t + r] + d));
            for (int64_t g = 0; g < per; g++) {
                vf acc[8];
                for (int r = 0; r < 8; r++) acc[r] = vset1(0.f);
                for (int64_t d = 0; d < dim; d += W) {
                    const vf qv = vload(qf + g * dim + d);
                    for (int r = 0; r < 8; r++) acc[r] = vfmadd(qv, vload(kf + r * dim + d), acc[r]);
                }
                vstore(scores + g * stride + t, vsum8(acc));
            }
        }
#endif
        for (; t < len; t++) {
            for (int64_t d = 0; d < dim; d += W) vstore(kf + d, vload_bf16(kpool + off[t] + d));
            for (int64_t g = 0; g < per; g++) scores[g * stride + t] = dot_f32(qf + g * dim, kf, dim);
        }
        return;
    }
#endif
    for (int64_t g = 0; g < per; g++) score_rows(scores + g * stride, qf + g * dim, kpool, off, len, dim);
}

#ifdef W
#define CHUNK_ROWS 16 /* rows of a sequence taken together across its kv heads: a page of 16 at most */

/* The whole pool rows (all kv heads, `row` values) of rows [t0, t0 + CHUNK_ROWS) below len. */
static inline void prefetch_rows(const uint16_t *pool, const int64_t *off, int64_t t0, int64_t len, int64_t row) {
    const int64_t t1 = t0 + CHUNK_ROWS < len ? t0 + CHUNK_ROWS : len;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < row * 2; b += 64) __builtin_prefetch((const char *)(pool + off[t]) + b, 0, 3);
}

/* One sequence, every head, reading its K/V rows in chunks of CHUNK_ROWS with all kv heads
 * inside a chunk. Why: a pool row holds all kv heads of a token ([page_size, kv_heads, dim]);
 * a task over one kv head reads one slice of every row (128 of 384 bytes for SmolLM2's 3 heads),
 * and the three tasks over the same rows run apart in time, so each pass strides through the
 * pages. Here a chunk's rows are read whole within a short time, page after page: at batch 32
 * the call is bound by these reads, not by arithmetic (AVX2 and AVX-512 took the same time).
 * Each head's arithmetic is that of score_rows_group and weighted_rows, in the same order (the
 * 8-row blocks of the scores start at the same rows: chunks are multiples of 8), so the same bits.
 * scratch: heads * (len + 2 * dim) + 8 * dim floats; off: len. Returns -1 when the scratch
 * cannot be allocated. */
static int attend_sequence(const uint16_t *q, const uint16_t *kpool, const uint16_t *vpool, const int64_t *table,
                           int64_t len, uint16_t *out, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t page_size, float scale) {
    const int64_t group = heads / kv_heads, row = kv_heads * dim;
    int64_t *off = malloc((size_t)len * sizeof(int64_t) + (size_t)(heads * (len + 2 * dim) + 8 * dim) * sizeof(float));
    if (off == NULL) return -1;
    float *scores = (float *)(off + len), *qf = scores + heads * len, *acc = qf + heads * dim, *kf = acc + heads * dim;
    for (int64_t i = 0; i < heads * dim; i++) qf[i] = bf16_to_f32(q[i]) * scale;
    row_offsets(off, table, len, page_size, row, 0);
    for (int64_t t0 = 0; t0 < len; t0 += CHUNK_ROWS) {
        const int64_t n = len - t0 < CHUNK_ROWS ? len - t0 : CHUNK_ROWS;
        prefetch_rows(kpool, off, t0 + CHUNK_ROWS, len, row);
        for (int64_t h = 0; h < kv_heads; h++)
            score_rows_group(scores + h * group * len + t0, len, qf + h * group * dim, group, kpool + h * dim,
                             off + t0, n, dim, kf);
    }
    prefetch_rows(vpool, off, 0, len, row); /* V's first chunk, while the softmax runs */
    float total[256];
    for (int64_t g = 0; g < heads; g++) {
        float *p = scores + g * len, top = -INFINITY;
        for (int64_t t = 0; t < len; t++) top = p[t] > top ? p[t] : top;
        total[g] = exponentiate(p, len, top);
    }
    for (int64_t i = 0; i < heads * dim; i++) acc[i] = 0.f;
    for (int64_t t0 = 0; t0 < len; t0 += CHUNK_ROWS) {
        const int64_t n = len - t0 < CHUNK_ROWS ? len - t0 : CHUNK_ROWS;
        prefetch_rows(vpool, off, t0 + CHUNK_ROWS, len, row);
        for (int64_t g = 0; g < heads; g++)
            weighted_sum(acc + g * dim, scores + g * len + t0, vpool + g / group * dim, off + t0, n, dim, 1);
    }
    for (int64_t g = 0; g < heads; g++)
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = f32_to_bf16(acc[g * dim + d] / total[g]);
    free(off);
    return 0;
}
#endif

/* q [B, heads, dim] with `q_stride` values from one sequence's row to the next (a view of the
 * fused qkv projection: no copy), out [B, heads, dim]; pages [B, page_stride] page ids; lens [B]
 * tokens to attend to (>= 1). Returns 0, or -1 when a scratch buffer cannot be allocated (out
 * then undefined).
 *
 * A task is one sequence's whole GQA group of query heads over their kv head: its K/V rows are
 * found, read and widened once per group instead of once per head (on another thread, often),
 * and stay in this core's cache while the group's heads use them. With too few tasks to keep
 * every thread busy (batch 1: kv_heads tasks), a task is one query head, as before. Each head's
 * arithmetic is the same either way: its result does not depend on the grouping. */
int ketch_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kpool, const uint16_t *vpool,
                                const int64_t *pages, int64_t page_stride, const int64_t *lens,
                                uint16_t *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t page_size, float scale, int nthreads) {
    const int64_t group = heads / kv_heads, row = kv_heads * dim;
    int failed = 0;
#ifdef W
    if (batch >= 2 * (int64_t)nthreads && heads <= 256 && dim % W == 0 && (dim == 64 || dim == 128 || dim == 256)) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
        for (int64_t b = 0; b < batch; b++)
            failed |= attend_sequence(q + b * q_stride, kpool, vpool, pages + b * page_stride, lens[b],
                                      out + b * heads * dim, heads, kv_heads, dim, page_size, scale) != 0;
        return failed ? -1 : 0;
    }
#endif
    const int64_t per = batch * kv_heads >= 2 * (int64_t)nthreads ? group : 1, tasks_per_seq = heads / per;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t task = 0; task < batch * tasks_per_seq; task++) {
        const int64_t b = task / tasks_per_seq, h0 = task % tasks_per_seq * per, kvh = h0 / group, len = lens[b];
        int64_t *off = malloc((size_t)len * sizeof(int64_t) + (size_t)(per * (len + 2 * dim) + 8 * dim) * sizeof(float));
        if (off == NULL) {
            failed = 1;
            continue;
        }
        float *scores = (float *)(off + len), *qf = scores + per * len, *acc = qf + per * dim, *kf = acc + per * dim;
        for (int64_t g = 0; g < per; g++)
            for (int64_t d = 0; d < dim; d++) qf[g * dim + d] = bf16_to_f32(q[b * q_stride + (h0 + g) * dim + d]) * scale;
        row_offsets(off, pages + b * page_stride, len, page_size, row, kvh * dim);
        score_rows_group(scores, len, qf, per, kpool, off, len, dim, kf);
        for (int64_t g = 0; g < per; g++) {
            float *p = scores + g * len, top = -INFINITY;
            for (int64_t t = 0; t < len; t++) top = p[t] > top ? p[t] : top; /* not fmaxf: a libm call per score */
            const float total = exponentiate(p, len, top);
            weighted_sum(acc, p, vpool, off, len, dim, 0);  /* the group's V rows: from this core's cache after the first head */
            for (int64_t d = 0; d < dim; d++) out[(b * heads + h0 + g) * dim + d] = f32_to_bf16(acc[d] / total);
        }
        free(off);
    }
    return failed ? -1 : 0;
}

/* The step's own K/V first: row b of k / v ([B, kv_heads, dim], `k_stride` / `v_stride` values
 * from one row to the next) into slot slots[b] of the pools, then the attention, which reads them. One call a
 * layer instead of two index_copy_ and this one: at batch 1 the store alone cost ~14 us a layer
 * through torch (dispatch, views, the dtype check), ~0.4 ms of a ~8 ms step. */
int ketch_store_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                      const uint16_t *v, int64_t v_stride, const int64_t *slots, uint16_t *kpool, uint16_t *vpool,
                                      const int64_t *pages, int64_t page_stride, const int64_t *lens,
                                      uint16_t *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                      int64_t page_size, float scale, int nthreads) {
    const int64_t row = kv_heads * dim;
    for (int64_t b = 0; b < batch; b++) {
        memcpy(kpool + slots[b] * row, k + b * k_stride, (size_t)row * sizeof(uint16_t));
        memcpy(vpool + slots[b] * row, v + b * v_stride, (size_t)row * sizeof(uint16_t));
    }
    return ketch_decode_attention_bf16(q, q_stride, kpool, vpool, pages, page_stride, lens, out, batch, heads,
                                       kv_heads, dim, page_size, scale, nthreads);
}
