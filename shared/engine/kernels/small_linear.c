/* y = x @ W.T (+ bias) for the few rows of a decode step, float32, W in its plain (out, in) layout.
 *
 * With one or two rows a linear is bound by reading its weights: each weight is used once a row. oneDNN's
 * packed GEMM and MKL's read them at about half of what one core streams (12-15 GB/s against 22-28 on a
 * Zen 4 core, measured), so this kernel reads W once, one weight row after the other (one sequential
 * stream: reading four rows side by side, or the inputs as the outer loop, measured slower), each 16-float
 * slice multiplied into every input row of a tile (the inputs, rows x in floats, stay in L1):
 *   - AVX-512, the tile's row count a compile-time constant (1-4) so its accumulators stay in registers;
 *   - portable C, for other CPUs (exported too, so tests check it on any machine).
 * From about four rows a step is bound by the multiplies instead, where oneDNN's blocked layout does better:
 * `shared.engine.packed_linear` times both and sends each row count to the faster one.
 * The output features are split over `threads` threads of torch's OpenMP pool. Each output is one dot
 * product summed in float32 (16 lanes, then across them): it differs from a BLAS GEMM's order in the last
 * bits, as oneDNN's packed layout does too.
 */
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROW_TILE 4

static inline float bias_of(const float *bias, int64_t n) { return bias ? bias[n] : 0.0f; }

/* ---- portable path: outputs [first, last) for every row ---- */
static void outputs_portable(const float *x, int64_t rows, int64_t in, const float *w, const float *bias, float *y,
                             int64_t out, int64_t first, int64_t last) {
    for (int64_t n = first; n < last; n++) {
        const float *w_row = w + n * in;
        for (int64_t m = 0; m < rows; m++) {
            const float *xm = x + m * in;
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int64_t k = 0; k < in; k++) dot += xm[k] * w_row[k];
            y[m * out + n] = dot + bias_of(bias, n);
        }
    }
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
        for (int i = 0; i < R; i++) y[i * out + n] = _mm512_reduce_add_ps(acc[i]) + bias_of(bias, n);
    }
}

static void outputs_avx512(const float *x, int64_t rows, int64_t in, const float *w, const float *bias, float *y,
                           int64_t out, int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_TILE) {
        const float *xm = x + m0 * in;
        float *ym = y + m0 * out;
        switch (rows - m0 < ROW_TILE ? rows - m0 : ROW_TILE) {
        case 1: tile_avx512(xm, 1, in, w, bias, ym, out, first, last); break;
        case 2: tile_avx512(xm, 2, in, w, bias, ym, out, first, last); break;
        case 3: tile_avx512(xm, 3, in, w, bias, ym, out, first, last); break;
        default: tile_avx512(xm, 4, in, w, bias, ym, out, first, last); break;
        }
    }
}
#endif

static void run(const float *x, int64_t rows, int64_t in, const float *w, const float *bias, float *y, int64_t out,
                int threads, int simd) {
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
        /* Each thread a contiguous run of outputs, 16 at a time, so no two write one cache line of a row. */
        const int64_t lines = (out + 15) / 16;
        const int64_t first = lines * me / team * 16;
        int64_t last = lines * (me + 1) / team * 16;
        if (last > out) last = out;
#if defined(__AVX512F__)
        if (simd) outputs_avx512(x, rows, in, w, bias, y, out, first, last);
        else
#endif
            outputs_portable(x, rows, in, w, bias, y, out, first, last);
        (void)simd;
    }
}

/* x: [rows, in], w: [out, in], bias: [out] or NULL, y: [rows, out]; every tensor contiguous float32. */
void small_linear(const float *x, int64_t rows, int64_t in, const float *w, const float *bias, float *y,
                  int64_t out, int threads) {
    run(x, rows, in, w, bias, y, out, threads, 1);
}

/* The portable implementation alone, whatever the build targets. */
void small_linear_portable(const float *x, int64_t rows, int64_t in, const float *w, const float *bias, float *y,
                           int64_t out, int threads) {
    run(x, rows, in, w, bias, y, out, threads, 0);
}
