/* A decoder layer's norms and RoPE on bf16 rows, each in one pass.
 *
 * Why: at batch 1 on the CPU these are tiny (a 576-wide row), and torch runs each as several
 * aten ops (RMSNorm: pow, mean, add, rsqrt, mul, two casts) at a few microseconds apiece: ~20 us
 * a norm, 61 norms a step. One C call is ~2 us.
 *
 * Numerics: what torch's bf16 ops compute, rounding to bf16 where they round (ketch/kernels/
 * README.md's contract for fused kernels): fp32 arithmetic inside an op, bf16 between ops.
 *   rms_norm:     y = bf16(bf16(x * r) * w),  r = 1 / sqrt(mean(x^2) + eps)   (F.rms_norm, then * w)
 *   add_rms_norm: s = bf16(residual + x), then rms_norm(s)
 *   rotary:       y = bf16(bf16(x * cos) + bf16(swap_halves(x) * sin))   (sin signed per half)
 * Only the order of the fp32 sum of squares can differ from torch's. (SiLU·mul stays torch's: a
 * scalar expf per element made it 1.6x slower than torch's vectorized op at one token, 5x at 32.)
 */
#include "block_common.h" /* bf16_to_f32, f32_to_bf16 (torch's rounding) */

static inline float round_bf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static void norm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t d, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < d; i++) {
        const float v = bf16_to_f32(x[i]);
        ss += v * v;
    }
    const float r = 1.f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; i++) y[i] = f32_to_bf16(round_bf(bf16_to_f32(x[i]) * r) * bf16_to_f32(w[i]));
}

void ketch_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t t, int64_t d, float eps) {
#pragma omp parallel for if (t > 16) schedule(static)
    for (int64_t i = 0; i < t; i++) norm_row(x + i * d, w, y + i * d, d, eps);
}

/* s = residual + x (written to `sum`), y = rms_norm(s) * w. */
void ketch_add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *y,
                             uint16_t *sum, int64_t t, int64_t d, float eps) {
#pragma omp parallel for if (t > 16) schedule(static)
    for (int64_t i = 0; i < t; i++) {
        for (int64_t j = 0; j < d; j++) sum[i * d + j] = f32_to_bf16(bf16_to_f32(residual[i * d + j]) + bf16_to_f32(x[i * d + j]));
        norm_row(sum + i * d, w, y + i * d, d, eps);
    }
}

/* In place: x [t, heads, dim] (token stride `stride`, heads contiguous), cos / sin [t, dim] bf16
 * (sin already signed: -sin | sin), rotate-half layout. */
void ketch_rotary_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t t, int64_t heads,
                       int64_t dim, int64_t stride) {
    const int64_t half = dim / 2;
#pragma omp parallel for if (t > 16) schedule(static)
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *c = cos + i * dim, *s = sin + i * dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + i * stride + h * dim;
            for (int64_t j = 0; j < half; j++) {
                const float a = bf16_to_f32(v[j]), b = bf16_to_f32(v[j + half]);
                v[j] = f32_to_bf16(round_bf(a * bf16_to_f32(c[j])) + round_bf(b * bf16_to_f32(s[j])));
                v[j + half] = f32_to_bf16(round_bf(b * bf16_to_f32(c[j + half])) + round_bf(a * bf16_to_f32(s[j + half])));
            }
        }
    }
}
