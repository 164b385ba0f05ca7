/* The small per-layer ops of a decoder layer, each one pass over memory instead of
 * several torch kernels: residual add + RMSNorm, rotary embedding, SiLU-and-multiply.
 *
 * Arithmetic follows transformers' modules step by step, including where they round
 * to bfloat16 between steps, so bfloat16 results match theirs as float32 ones do.
 * Rows are contiguous; `bf16` selects bfloat16 storage (else float32). Built with fast math:
 * nothing here reaches an infinity or a NaN from finite inputs.
 *
 * Rows are independent, so each kernel splits them over `threads` threads of the OpenMP pool torch
 * computes with (a prompt's thousands of rows); the result is the same for any number of threads.
 */
#include <math.h>
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "storage.h"

/* Each kernel's body is inlined twice, with `bf16` a constant 0 or 1, so each copy's loops vectorize; the
 * copies run inside the parallel region (an outlined region would take `bf16` as a variable), each thread on
 * its share of rows [first, last). */
#if defined(_OPENMP)
#define SPLIT_ROWS(rows, call)                                                                   \
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")                                \
    {                                                                                            \
        const int64_t me_ = omp_get_thread_num(), team_ = omp_get_num_threads();               \
        const int64_t first = (rows) * me_ / team_, last = (rows) * (me_ + 1) / team_;         \
        if (bf16) call(1); else call(0);                                                         \
    }
#else
#define SPLIT_ROWS(rows, call)                                                                   \
    do { const int64_t first = 0, last = (rows); (void)threads; if (bf16) call(1); else call(0); } while (0)
#endif

/* residual += x (if add_residual), then x = weight * rms_norm(residual), per row of `hidden`. */
static inline __attribute__((always_inline)) void add_rms_norm_impl(
        void *x, void *residual, const void *weight, int64_t first, int64_t last, int64_t hidden, float eps,
        int add_residual, const int bf16) {
    for (int64_t r = first; r < last; r++) {
        const int64_t base = r * hidden;
        double sum = 0.0;
        for (int64_t i = 0; i < hidden; i++) {
            float h = ld(residual, base + i, bf16);
            if (add_residual) { h = rnd(h + ld(x, base + i, bf16), bf16); st(residual, base + i, h, bf16); }
            sum += (double)h * h;
        }
        const float inv = 1.0f / sqrtf((float)(sum / hidden) + eps);
        for (int64_t i = 0; i < hidden; i++) {
            const float normed = rnd(ld(residual, base + i, bf16) * inv, bf16);
            st(x, base + i, ld(weight, i, bf16) * normed, bf16);
        }
    }
}

void add_rms_norm(void *x, void *residual, const void *weight, int64_t rows, int64_t hidden, float eps,
                  int add_residual, int bf16, int threads) {
#define CALL(b) add_rms_norm_impl(x, residual, weight, first, last, hidden, eps, add_residual, b)
    SPLIT_ROWS(rows, CALL);
#undef CALL
}

/* In place on x[t][h][:] for every token t and head h (row stride `row_stride` elements, heads
 * `head_dim` apart): x = x * cos + rotate_half(x) * sin, with cos/sin [tokens][head_dim]. */
static inline __attribute__((always_inline)) void rotary_impl(
        void *x, const void *cos, const void *sin, int64_t first, int64_t last, int64_t heads, int64_t head_dim,
        int64_t row_stride, const int bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t t = first; t < last; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = ld(x, base + i, bf16), x2 = ld(x, base + half + i, bf16);
                const float c1 = ld(cos, t * head_dim + i, bf16), s1 = ld(sin, t * head_dim + i, bf16);
                const float c2 = ld(cos, t * head_dim + half + i, bf16), s2 = ld(sin, t * head_dim + half + i, bf16);
                const float out1 = rnd(x1 * c1, bf16) + rnd(-x2 * s1, bf16);
                const float out2 = rnd(x2 * c2, bf16) + rnd(x1 * s2, bf16);
                st(x, base + i, out1, bf16);
                st(x, base + half + i, out2, bf16);
            }
        }
    }
}

void rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads, int64_t head_dim,
            int64_t row_stride, int bf16, int threads) {
#define CALL(b) rotary_impl(x, cos, sin, first, last, heads, head_dim, row_stride, b)
    SPLIT_ROWS(tokens, CALL);
#undef CALL
}

/* out[t][:] = silu(gate_up[t][:n]) * gate_up[t][n:], gate_up [tokens][2n], out [tokens][n].
 * exp's argument is capped so it never overflows (silu there is -0 either way). */
static inline __attribute__((always_inline)) void silu_and_mul_impl(
        const void *gate_up, void *out, int64_t first, int64_t last, int64_t n, const int bf16) {
    for (int64_t t = first; t < last; t++) {
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float g = ld(gate_up, t * 2 * n + i, bf16), u = ld(gate_up, t * 2 * n + n + i, bf16);
            st(out, t * n + i, rnd(g / (1.0f + expf(fminf(-g, 80.0f))), bf16) * u, bf16);
        }
    }
}

void silu_and_mul(const void *gate_up, void *out, int64_t tokens, int64_t n, int bf16, int threads) {
#define CALL(b) silu_and_mul_impl(gate_up, out, first, last, n, b)
    SPLIT_ROWS(tokens, CALL);
#undef CALL
}
