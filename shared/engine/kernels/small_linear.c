/* y = x @ W.T (+ bias) for the few rows of a decode step, W in its plain (out, in) layout; float32, or
 * bfloat16 (`bf16` set: every tensor bfloat16, products summed in float32, the output rounded to nearest even).
 *
 * With one or two rows a linear is bound by reading its weights: each weight is used once a row. oneDNN's
 * packed GEMM and MKL's read them at about half of what one core streams (12-15 GB/s against 22-28 on a
 * Zen 4 core, measured), so this kernel reads W once, one weight row after the other (one sequential
 * stream: reading four rows side by side, or the inputs as the outer loop, measured slower), each 16-float
 * slice multiplied into every input row of a tile (the inputs, rows x in floats, stay in L1):
 *   - AVX-512, the tile's row count a compile-time constant (1-4) so its accumulators stay in registers;
 *     bfloat16 with AVX512-BF16's dot products of pairs (32 weights an instruction, summed in float32);
 *   - portable C, for other CPUs and bfloat16 without AVX512-BF16 (exported too, so tests check it anywhere).
 * From about four rows a step is bound by the multiplies instead, where oneDNN's blocked layout does better:
 * `shared.engine.packed_linear` times both and sends each row count to the faster one.
 * The output features are split over `threads` threads of torch's OpenMP pool. Each output is one dot
 * product summed in float32 (16 lanes, then across them): it differs from a BLAS GEMM's order in the last
 * bits, as oneDNN's packed layout does too.
 */
#include <stdint.h>

#include "storage.h"
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROW_TILE 4

/* ---- portable path: outputs [first, last) for every row (bf16 a constant at each call site) ---- */
static inline __attribute__((always_inline)) void outputs_portable_impl(
        const void *x, int64_t rows, int64_t in, const void *w, const void *bias, void *y, int64_t out,
        int64_t first, int64_t last, const int bf16) {
    for (int64_t n = first; n < last; n++) {
        for (int64_t m = 0; m < rows; m++) {
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int64_t k = 0; k < in; k++) dot += ld(x, m * in + k, bf16) * ld(w, n * in + k, bf16);
            st(y, m * out + n, dot + (bias ? ld(bias, n, bf16) : 0.0f), bf16);
        }
    }
}

static void outputs_portable(const void *x, int64_t rows, int64_t in, const void *w, const void *bias, void *y,
                             int64_t out, int64_t first, int64_t last, int bf16) {
    if (bf16) outputs_portable_impl(x, rows, in, w, bias, y, out, first, last, 1);
    else outputs_portable_impl(x, rows, in, w, bias, y, out, first, last, 0);
}

#if defined(__AVX512F__)
/* Outputs [first, last) for the R input rows at x (R a constant at each call site). */
static inline __attribute__((always_inline)) void tile_avx512(const float *x, const int R, int64_t in,
                                                              const float *w, const float *bias, float *y,
                                                              int64_t out, int64_t first, int64_t last) {
    const int64_t body = in & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (in - body)) - 1u);
    for (int64_t n = first; n < last; n++) {
        const float *w_row = w + n * in;
        __m512 acc[ROW_TILE];
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < body; k += 16) {
            const __m512 weights = _mm512_loadu_ps(w_row + k);
            for (int i = 0; i < R; i++) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * in + k), weights, acc[i]);
        }
        if (tail) {
            const __m512 weights = _mm512_maskz_loadu_ps(tail, w_row + body);
            for (int i = 0; i < R; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + i * in + body), weights, acc[i]);
        }
        for (int i = 0; i < R; i++) y[i * out + n] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[n] : 0.0f);
    }
}

/* Each tile of up to ROW_TILE input rows through `tile` (an inlined function), its row count a constant there. */
#define FOR_EACH_TILE(type, tile)                                                                    \
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_TILE) {                                                \
        const type *xm = x + m0 * in;                                                                \
        type *ym = y + m0 * out;                                                                     \
        switch (rows - m0 < ROW_TILE ? rows - m0 : ROW_TILE) {                                       \
        case 1: tile(xm, 1, in, w, bias, ym, out, first, last); break;                               \
        case 2: tile(xm, 2, in, w, bias, ym, out, first, last); break;                               \
        case 3: tile(xm, 3, in, w, bias, ym, out, first, last); break;                               \
        default: tile(xm, 4, in, w, bias, ym, out, first, last); break;                              \
        }                                                                                            \
    }

static void outputs_avx512(const float *x, int64_t rows, int64_t in, const float *w, const float *bias, float *y,
                           int64_t out, int64_t first, int64_t last) {
    FOR_EACH_TILE(float, tile_avx512)
}
#endif

#if defined(__AVX512BF16__)
/* bfloat16: outputs [first, last) for the R input rows at x, 32 weights at a time. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, const int R, int64_t in,
                                                            const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                                            int64_t out, int64_t first, int64_t last) {
    const int64_t body = in & ~(int64_t)31;
    const __mmask32 tail = (__mmask32)((1ull << (in - body)) - 1u);
    for (int64_t n = first; n < last; n++) {
        const uint16_t *w_row = w + n * in;
        __m512 acc[ROW_TILE];
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < body; k += 32) {
            const __m512bh weights = (__m512bh)_mm512_loadu_si512(w_row + k);
            for (int i = 0; i < R; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + i * in + k), weights);
        }
        if (tail) {
            const __m512bh weights = (__m512bh)_mm512_maskz_loadu_epi16(tail, w_row + body);
            for (int i = 0; i < R; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + i * in + body),
                                          weights);
        }
        for (int i = 0; i < R; i++)
            st(y, i * out + n, _mm512_reduce_add_ps(acc[i]) + (bias ? ld(bias, n, 1) : 0.0f), 1);
    }
}

static void outputs_bf16(const uint16_t *x, int64_t rows, int64_t in, const uint16_t *w, const uint16_t *bias,
                         uint16_t *y, int64_t out, int64_t first, int64_t last) {
    FOR_EACH_TILE(uint16_t, tile_bf16)
}
#endif

static void run(const void *x, int64_t rows, int64_t in, const void *w, const void *bias, void *y, int64_t out,
                int bf16, int threads, int simd) {
#if defined(_OPENMP)
    #pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#if defined(_OPENMP)
        const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
#else
        const int64_t me = 0, team = 1;
        (void)threads;
#endif
        /* Each thread a contiguous run of outputs, 32 at a time, so no two write one cache line of a row. */
        const int64_t lines = (out + 31) / 32;
        const int64_t first = lines * me / team * 32;
        int64_t last = lines * (me + 1) / team * 32;
        if (last > out) last = out;
        int done = 0;
#if defined(__AVX512F__)
        if (simd && !bf16) {
            outputs_avx512(x, rows, in, w, bias, y, out, first, last);
            done = 1;
        }
#endif
#if defined(__AVX512BF16__)
        if (simd && bf16) {
            outputs_bf16(x, rows, in, w, bias, y, out, first, last);
            done = 1;
        }
#endif
        if (!done) outputs_portable(x, rows, in, w, bias, y, out, first, last, bf16);
        (void)simd;
    }
}

/* x: [rows, in], w: [out, in], bias: [out] or NULL, y: [rows, out]; every tensor contiguous, float32 or (bf16
 * set) bfloat16. */
void small_linear(const void *x, int64_t rows, int64_t in, const void *w, const void *bias, void *y, int64_t out,
                  int bf16, int threads) {
    run(x, rows, in, w, bias, y, out, bf16, threads, 1);
}

/* The portable implementation alone, whatever the build targets. */
void small_linear_portable(const void *x, int64_t rows, int64_t in, const void *w, const void *bias, void *y,
                           int64_t out, int bf16, int threads) {
    run(x, rows, in, w, bias, y, out, bf16, threads, 0);
}
