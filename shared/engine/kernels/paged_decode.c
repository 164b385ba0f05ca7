/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * Per sequence the kernel first lists the cache slot of every position it attends to
 * (one lookup per position, no gather into a padded copy). Then, per KV head, it computes
 * the scores of that head's group of query heads, a softmax in float32, and the weighted
 * sum of the values. The (sequence, KV head) pairs are split over `num_threads` threads.
 *
 * Two implementations of the per-KV-head work, same arithmetic up to summation order:
 *   - AVX-512 (built where the compiler targets it, head_dim a multiple of 16): a score is a
 *     chain of fused multiply-adds over head_dim; sixteen positions' chains are reduced
 *     together with one transpose-and-add tree, and the weighted values accumulate in
 *     registers for several query heads at once.
 *   - portable C, for every other case (exported too, so tests check it on any machine).
 *
 * Layouts (element strides, row-major):
 *   query       [tokens][heads][head_dim], rows `token_index[i]`, row stride `query_row_stride`
 *   key/value   [blocks][block_size][kv_heads][head_dim] of one layer (contiguous)
 *   block_table [num_seqs][table_width] (int64), context_lens [num_seqs] (int64)
 *   out         [tokens][heads][head_dim] (contiguous), rows `token_index[i]`
 * `window` > 0 attends to the last `window` positions only.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "storage.h"

typedef struct {
    const void *query; int64_t query_row_stride;
    const int64_t *token_index;
    const void *key_cache; const void *value_cache;
    const int64_t *block_table; int64_t table_width;
    const int64_t *context_lens;
    int64_t num_seqs, block_size, num_kv_heads, group, head_dim, window;
    float scale;
    void *out;
    int is_bf16;
    int use_simd;
} Job;

/* Per-thread scratch, sized for the longest sequence. */
typedef struct {
    int64_t *slots;  /* [max_len] cache slot of each attended position */
    float *scores;   /* [group][max_len] */
    float *query;    /* [group][head_dim] the group's queries, scaled, as float32 */
    float *row;      /* [head_dim] one key or value row as float32 (portable path) */
    float *partial;  /* [16][group][16] per-position partial sums (AVX-512 path), 64-byte aligned */
} Scratch;

/* Softmax of each of `rows` score rows (`n` long, `stride` apart), in place. */
static void softmax_rows(float *scores, int64_t rows, int64_t n, int64_t stride) {
    for (int64_t h = 0; h < rows; h++) {
        float *sh = scores + h * stride, mx = -FLT_MAX, sum = 0.f;
        #pragma omp simd reduction(max:mx)
        for (int64_t i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t i = 0; i < n; i++) { sh[i] = expf(sh[i] - mx); sum += sh[i]; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) sh[i] *= inv;
    }
}

/* `n` elements at `offset` as float32: in place for float32, else converted into `dst`. */
static inline const float *as_f32(float *dst, const void *src, int64_t offset, int64_t n, int is_bf16) {
    if (!is_bf16) return (const float *)src + offset;
    for (int64_t i = 0; i < n; i++) dst[i] = ld(src, offset + i, 1);
    return dst;
}

/* ---- portable path: one KV head's query group ---- */
static void kv_head_portable(const Job *job, const Scratch *s, int64_t n, int64_t kv, int64_t out_row) {
    const int64_t D = job->head_dim, G = job->group, KV = job->num_kv_heads;
    for (int64_t i = 0; i < n; i++) {
        const float *k = as_f32(s->row, job->key_cache, (s->slots[i] * KV + kv) * D, D, job->is_bf16);
        for (int64_t h = 0; h < G; h++) {
            const float *qh = s->query + h * D;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];
            s->scores[h * n + i] = dot;
        }
    }
    softmax_rows(s->scores, G, n, n);
    for (int64_t h = 0; h < G; h++) {
        float *acc = s->query + h * D;  /* the query row is spent: reuse it as the accumulator */
        memset(acc, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t i = 0; i < n; i++) {
        const float *v = as_f32(s->row, job->value_cache, (s->slots[i] * KV + kv) * D, D, job->is_bf16);
        for (int64_t h = 0; h < G; h++) {
            const float w = s->scores[h * n + i];
            float *acc = s->query + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[d] += w * v[d];
        }
    }
    for (int64_t h = 0; h < G; h++)
        for (int64_t d = 0; d < D; d++)
            st(job->out, (out_row + kv * G + h) * D + d, s->query[h * D + d], job->is_bf16);
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t offset, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + offset);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* Positions ahead whose rows are prefetched: with 30 layers' KV the rows come from DRAM, and the hardware
 * prefetcher does not follow a sequence's blocks across pages (16 and 32 measured alike, 8 slower). */
#define PREFETCH_AHEAD 32
static inline __attribute__((always_inline)) void prefetch_row(
        const void *cache, const Scratch *s, int64_t i, int64_t n, int64_t kv, int64_t KV, int64_t D, const int bf16) {
    if (i >= n) return;
    const char *row = (const char *)cache + (s->slots[i] * KV + kv) * D * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < D * (bf16 ? 2 : 4); b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

/* Lane i of the result is the sum of v[i]'s sixteen lanes. */
static inline __attribute__((always_inline)) __m512 sum_each16(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: [a, b, c, d] summed within the lane */
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* Sum the four 128-bit lanes: quads[i] holds vectors 4i..4i+3. */
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

/* Scores of `G` query heads against positions [0, n) of KV head `kv`; `DV` = head_dim / 16. */
static inline __attribute__((always_inline)) void scores_avx512(
        const Job *job, const Scratch *s, int64_t n, int64_t kv, const int DV, const int bf16) {
    const int64_t G = job->group, KV = job->num_kv_heads, D = (int64_t)DV * 16;
    __m512 *partial = (__m512 *)s->partial;  /* [16][G] */
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int64_t m = n - i0 < 16 ? n - i0 : 16;
        for (int64_t i = 0; i < m; i++) {
            const int64_t base = (s->slots[i0 + i] * KV + kv) * D;
            prefetch_row(job->key_cache, s, i0 + i + PREFETCH_AHEAD, n, kv, KV, D, bf16);
            __m512 k[16];
            for (int c = 0; c < DV; c++) k[c] = load16(job->key_cache, base + 16 * c, bf16);
            for (int64_t h = 0; h < G; h++) {
                const float *q = s->query + h * D;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
                for (int c = 1; c < DV; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), k[c], acc);
                partial[i * G + h] = acc;
            }
        }
        for (int64_t h = 0; h < G; h++) {
            __m512 rows[16];
            for (int64_t i = 0; i < 16; i++) rows[i] = i < m ? partial[i * G + h] : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(s->scores + h * n + i0, (__mmask16)((1u << m) - 1), sum_each16(rows));
        }
    }
}

/* Weighted values of query heads [h0, h0 + HC) of KV head `kv`, stored in `out`. */
static inline __attribute__((always_inline)) void values_avx512(
        const Job *job, const Scratch *s, int64_t n, int64_t kv, int64_t h0, int64_t out_row,
        const int DV, const int HC, const int bf16) {
    const int64_t G = job->group, KV = job->num_kv_heads, D = (int64_t)DV * 16;
    __m512 acc[16], v[16];  /* acc[h * DV + c]: fixed sizes, so the inlined copies keep them in registers */
    for (int j = 0; j < HC * DV; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const int64_t base = (s->slots[i] * KV + kv) * D;
        prefetch_row(job->value_cache, s, i + PREFETCH_AHEAD, n, kv, KV, D, bf16);
        for (int c = 0; c < DV; c++) v[c] = load16(job->value_cache, base + 16 * c, bf16);
        for (int h = 0; h < HC; h++) {
            const __m512 w = _mm512_set1_ps(s->scores[(h0 + h) * n + i]);
            for (int c = 0; c < DV; c++) acc[h * DV + c] = _mm512_fmadd_ps(w, v[c], acc[h * DV + c]);
        }
    }
    for (int h = 0; h < HC; h++) {
        float lanes[16];
        for (int c = 0; c < DV; c++) {
            _mm512_storeu_ps(lanes, acc[h * DV + c]);
            for (int l = 0; l < 16; l++)
                st(job->out, (out_row + kv * G + h0 + h) * D + 16 * c + l, lanes[l], bf16);
        }
    }
}

/* Heads per pass over the values: HC * DV accumulators plus DV value registers stay within 32. */
#define VALUES_FOR_DV(DV, MAXHC)                                                                        \
    do {                                                                                                \
        int64_t h0 = 0;                                                                                 \
        for (; h0 + (MAXHC) <= G; h0 += (MAXHC)) values_avx512(job, s, n, kv, h0, out_row, DV, MAXHC, bf16); \
        switch (G - h0) {                                                                               \
            case 0: break;                                                                              \
            case 1: values_avx512(job, s, n, kv, h0, out_row, DV, 1, bf16); break;                      \
            case 2: if ((MAXHC) > 2) values_avx512(job, s, n, kv, h0, out_row, DV, 2, bf16); break;     \
            case 3: if ((MAXHC) > 3) values_avx512(job, s, n, kv, h0, out_row, DV, 3, bf16); break;     \
            default: for (; h0 < G; h0++) values_avx512(job, s, n, kv, h0, out_row, DV, 1, bf16);       \
        }                                                                                               \
    } while (0)

static inline __attribute__((always_inline)) void kv_head_avx512_dv(
        const Job *job, const Scratch *s, int64_t n, int64_t kv, int64_t out_row, const int DV, const int bf16) {
    const int64_t G = job->group;
    scores_avx512(job, s, n, kv, DV, bf16);
    softmax_rows(s->scores, G, n, n);
    if (DV == 2) VALUES_FOR_DV(2, 8);
    else if (DV == 4) VALUES_FOR_DV(4, 4);
    else if (DV == 8) VALUES_FOR_DV(8, 2);
    else VALUES_FOR_DV(16, 1);
}

/* head_dim 32, 64, 128 or 256 (DV 2, 4, 8, 16): what the caller checked in `simd_serves`. */
static void kv_head_avx512(const Job *job, const Scratch *s, int64_t n, int64_t kv, int64_t out_row) {
    const int DV = (int)(job->head_dim / 16);
#define DISPATCH(bf16)                                                    \
    switch (DV) {                                                         \
        case 2: kv_head_avx512_dv(job, s, n, kv, out_row, 2, bf16); break;  \
        case 4: kv_head_avx512_dv(job, s, n, kv, out_row, 4, bf16); break;  \
        case 8: kv_head_avx512_dv(job, s, n, kv, out_row, 8, bf16); break;  \
        default: kv_head_avx512_dv(job, s, n, kv, out_row, 16, bf16); break; \
    }
    if (job->is_bf16) { DISPATCH(1) } else { DISPATCH(0) }
#undef DISPATCH
}

static int simd_serves(int64_t head_dim) {
    return head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}
#else
static int simd_serves(int64_t head_dim) { (void)head_dim; return 0; }
#endif

/* Work items [first, last) of the `num_seqs * num_kv_heads` (sequence, KV head) pairs. Returns -1 when scratch
 * memory ran out. */
static int run_items(const Job *job, int64_t first, int64_t last) {
    const int64_t D = job->head_dim, G = job->group, KV = job->num_kv_heads, H = KV * G, bs = job->block_size;
    if (first >= last) return 0;
    int64_t max_len = 1;
    for (int64_t seq = first / KV; seq <= (last - 1) / KV; seq++)
        if (job->context_lens[seq] > max_len) max_len = job->context_lens[seq];
    Scratch s;
    const size_t floats = (size_t)(G * max_len + G * D + D + 16 * G * 16);
    float *memory = aligned_alloc(64, (sizeof(float) * floats + sizeof(int64_t) * (size_t)max_len + 63) / 64 * 64);
    if (!memory) return -1;
    s.partial = memory;
    s.scores = s.partial + 16 * G * 16;
    s.query = s.scores + G * max_len;
    s.row = s.query + G * D;
    s.slots = (int64_t *)(s.row + D);
    int64_t listed = -1;  /* the sequence whose slots `s.slots` holds */
    for (int64_t item = first; item < last; item++) {
        const int64_t seq = item / KV, kv = item % KV;
        const int64_t len = job->context_lens[seq], token = job->token_index[seq];
        const int64_t start = (job->window > 0 && len > job->window) ? len - job->window : 0;
        const int64_t n = len - start;
        if (seq != listed) {
            const int64_t *table = job->block_table + seq * job->table_width;
            for (int64_t p = start, i = 0; p < len;) {  /* one table lookup per block */
                const int64_t block = p / bs, offset = p % bs;
                const int64_t run = bs - offset < len - p ? bs - offset : len - p, slot = table[block] * bs + offset;
                for (int64_t r = 0; r < run; r++) s.slots[i++] = slot + r;
                p += run;
            }
            listed = seq;
        }
        const int64_t q0 = token * job->query_row_stride + kv * G * D;
        for (int64_t j = 0; j < G * D; j++) s.query[j] = ld(job->query, q0 + j, job->is_bf16) * job->scale;
#if defined(__AVX512F__)
        if (job->use_simd) { kv_head_avx512(job, &s, n, kv, token * H); continue; }
#endif
        kv_head_portable(job, &s, n, kv, token * H);
    }
    free(memory);
    return 0;
}

/* The exported functions' parameters, and the same names passed on. */
#define DECODE_PARAMS                                                                              \
    const void *query, int64_t query_row_stride, const int64_t *token_index,                      \
    const void *key_cache, const void *value_cache,                                                \
    const int64_t *block_table, int64_t table_width, const int64_t *context_lens,                  \
    int64_t num_seqs, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,   \
    int64_t window, float scale, void *out, int is_bf16, int num_threads
#define DECODE_ARGS                                                                                \
    query, query_row_stride, token_index, key_cache, value_cache, block_table, table_width,        \
    context_lens, num_seqs, block_size, num_kv_heads, group, head_dim, window, scale, out, is_bf16, num_threads

/* Items are split evenly over `num_threads` threads of the OpenMP pool torch computes with: its workers are
 * already awake after the step's matrix multiplies, and extra threads of our own would compete with them. */
static int run_jobs(DECODE_PARAMS, int use_simd) {
    const int64_t items = num_seqs * num_kv_heads;
    if (items < 1) return 0;
    if (num_threads < 1) num_threads = 1;  /* more threads than items: some get none (a smaller team would end
                                               threads of torch's pool, which its next region starts again) */
    const Job job = {query, query_row_stride, token_index, key_cache, value_cache, block_table, table_width,
                     context_lens, num_seqs, block_size, num_kv_heads, group, head_dim, window, scale, out, is_bf16,
                     use_simd};
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        int64_t t = 0, threads = 1;
#if defined(_OPENMP)
        t = omp_get_thread_num();
        threads = omp_get_num_threads();
#endif
        failed |= run_items(&job, items * t / threads, items * (t + 1) / threads) != 0;
    }
    return failed ? -1 : 0;
}

/* The fastest implementation this build has for `head_dim`. Returns 0, or -1 when scratch memory ran out. */
int paged_decode_attention(DECODE_PARAMS) { return run_jobs(DECODE_ARGS, simd_serves(head_dim)); }

/* The portable implementation alone, whatever the build targets. */
int paged_decode_attention_portable(DECODE_PARAMS) { return run_jobs(DECODE_ARGS, 0); }
