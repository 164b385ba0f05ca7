/* Causal attention of prompt chunks straight from the paged KV cache (several query tokens per sequence).
 *
 * The step's keys and values are already in the cache, so one kernel serves a whole prompt and a chunk that
 * continues one. Work items are (span, KV head, block of BQ query rows); each item runs the flash-attention
 * recurrence over its keys in chunks of BK positions, never past its last row's own position (causal) nor
 * before its first row's window: scores of the block's query vectors (BQ rows x the KV head's query group)
 * against a chunk, an online softmax in float32 (running max and sum per query vector), and the weighted
 * values accumulated in float32. Items are taken dynamically by the threads (late blocks of a long prompt
 * attend to more keys than early ones).
 *
 * Three implementations of a chunk's two products, same arithmetic up to summation order:
 *   - bfloat16 pair dot products (AVX512-BF16, a bfloat16 cache, head_dim a multiple of 32): the chunk's keys
 *     transposed as pairs of dimensions and its values interleaved as pairs of positions, each instruction
 *     multiplies and adds two products per lane into float32;
 *   - AVX-512 (head_dim a multiple of 16): the chunk's keys are transposed once, then four query vectors'
 *     scores against its 64 positions stay in sixteen registers over the head dimension; the weighted values
 *     of several query vectors accumulate in registers per position;
 *   - portable C for every other case.
 * Each is exported (the fastest a build has, the float AVX-512 one and the portable one), so tests check all
 * that the machine runs.
 *
 * With a bfloat16 cache the arithmetic is the reference's (transformers' eager attention): products of the
 * bfloat16 inputs exact in float32, the scale applied to each score, and the probabilities rounded to
 * bfloat16 before they weight the values (their sum stays in float32). A float32 cache scales the queries.
 *
 * Layouts (element strides, row-major):
 *   query       [tokens][heads][head_dim], row stride `query_row_stride`
 *   key/value   [blocks][block_size][kv_heads][head_dim] of one layer (contiguous)
 *   spans       query_start, query_len, context_len [num_spans] (int64): span s's query row i sits at absolute
 *               position context_len - query_len + i, and attends to positions <= its own
 *   block_table [num_spans][table_width] (int64)
 *   out         [tokens][heads][head_dim] (contiguous)
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "storage.h"

#define BQ 16  /* query rows per work item */
#define BK 64  /* key positions per chunk */

typedef struct {
    const void *query; int64_t query_row_stride;
    const void *key_cache; const void *value_cache;
    const int64_t *query_start, *query_len, *context_len;
    const int64_t *block_table; int64_t table_width;
    int64_t num_spans, block_size, num_kv_heads, group, head_dim, window;
    float scale;
    void *out;
    int is_bf16, use_simd, use_bf16_dot;
} Job;

/* Which implementation computes: the portable C, AVX-512 in float, or bfloat16 pair dot products where they serve. */
enum { PORTABLE = 0, SIMD_FLOAT = 1, FASTEST = 2 };

typedef struct {
    int64_t *slots;  /* [max keys] cache slot of each key position of the item */
    float *q;        /* [BQ * group][head_dim] scaled queries */
    float *kt;       /* [head_dim][BK] the chunk's keys, transposed (zero past the chunk's end) */
    float *p;        /* [BQ * group][BK] scores, then probabilities */
    float *o;        /* [BQ * group][head_dim] weighted values, unnormalized */
    float *mx, *sum; /* [BQ * group] running max and sum of exponentials */
    /* The pair dot products' operands, bfloat16 bits: */
    uint16_t *qb;    /* [BQ * group][head_dim] queries */
    uint32_t *kt2;   /* [head_dim / 2][BK] the chunk's keys, word w of key j = its dimensions 2w, 2w + 1 */
    uint16_t *pb;    /* [BQ * group][BK] probabilities */
    uint32_t *vt2;   /* [BK / 2][head_dim] the chunk's values, word d of pair t = dimension d of keys 2t, 2t + 1 */
} Scratch;

/* ---- a chunk's two products: scores p[i][j] = q[i] . k[j], and o[i] += sum_j p[i][j] v[j] ---- */

static void scores_portable(const Scratch *s, int64_t nq, int64_t D, int64_t m) {
    for (int64_t i = 0; i < nq; i++) {
        float *row = s->p + i * BK;
        for (int64_t j = 0; j < m; j++) row[j] = 0.f;
        for (int64_t d = 0; d < D; d++) {
            const float qd = s->q[i * D + d];
            const float *k = s->kt + d * BK;
            #pragma omp simd
            for (int64_t j = 0; j < m; j++) row[j] += qd * k[j];
        }
    }
}

static void values_portable(const Job *job, const Scratch *s, int64_t nq, int64_t m, int64_t kv) {
    const int64_t D = job->head_dim, KV = job->num_kv_heads;
    for (int64_t j = 0; j < m; j++) {
        const int64_t base = (s->slots[j] * KV + kv) * D;
        for (int64_t i = 0; i < nq; i++) {
            const float w = s->p[i * BK + j];
            float *o = s->o + i * D;
            if (job->is_bf16) {
                for (int64_t d = 0; d < D; d++) o[d] += w * ld(job->value_cache, base + d, 1);
            } else {
                const float *v = (const float *)job->value_cache + base;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
            }
        }
    }
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t offset, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + offset);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* dst[c * stride + i] = r[i][c]: a 16 x 16 transpose of 32-bit elements through registers. */
static inline __attribute__((always_inline)) void transpose16(const __m512 r[16], float *dst, int64_t stride) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {  /* per 128-bit lane k: rows 2i, 2i+1 at columns 4k, 4k+1 | 4k+2, 4k+3 */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  /* u[4g + c], lane k: rows 4g..4g+3 at column 4k + c */
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * g + 1]), e = _mm512_castps_pd(t[4 * g + 3]);
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
    }
    for (int c = 0; c < 4; c++) {  /* column 4k + c gathers lane k of the four row groups */
        const __m512 x = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), y = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        const __m512 z = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 w = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        _mm512_storeu_ps(dst + c * stride, _mm512_shuffle_f32x4(x, z, 0x88));
        _mm512_storeu_ps(dst + (8 + c) * stride, _mm512_shuffle_f32x4(x, z, 0xDD));
        _mm512_storeu_ps(dst + (4 + c) * stride, _mm512_shuffle_f32x4(y, w, 0x88));
        _mm512_storeu_ps(dst + (12 + c) * stride, _mm512_shuffle_f32x4(y, w, 0xDD));
    }
}

/* kt[d][j] for the chunk's keys j in [0, m): 16 positions x 16 dimensions at a time through registers. */
static inline __attribute__((always_inline)) void transpose_keys_b(const Job *job, const Scratch *s, int64_t m,
                                                                   int64_t kv, const int bf16) {
    const int64_t D = job->head_dim, KV = job->num_kv_heads;
    int64_t j0 = 0;
    for (; j0 + 16 <= m; j0 += 16) {
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = load16(job->key_cache, (s->slots[j0 + i] * KV + kv) * D + d0, bf16);
            transpose16(r, s->kt + d0 * BK + j0, BK);
        }
    }
    for (; j0 < m; j0++) {
        const int64_t base = (s->slots[j0] * KV + kv) * D;
        for (int64_t d = 0; d < D; d++) s->kt[d * BK + j0] = ld(job->key_cache, base + d, bf16);
    }
}

static void transpose_keys_avx512(const Job *job, const Scratch *s, int64_t m, int64_t kv) {
    if (job->is_bf16) transpose_keys_b(job, s, m, kv, 1);
    else transpose_keys_b(job, s, m, kv, 0);
}

/* Scores of query vectors [i0, i0 + R) against the chunk's first 16 * NC positions: R x NC registers. */
static inline __attribute__((always_inline)) void scores_rows_avx512(const Scratch *s, int64_t i0, int64_t D,
                                                                     const int R, const int NC) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const float *k = s->kt + d * BK;
        __m512 kd[4];
        for (int c = 0; c < NC; c++) kd[c] = _mm512_loadu_ps(k + 16 * c);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(s->q[(i0 + r) * D + d]);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(a, kd[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(s->p + (i0 + r) * BK + 16 * c, acc[r][c]);
}

static inline __attribute__((always_inline)) void scores_nc_avx512(const Scratch *s, int64_t nq, int64_t D,
                                                                   const int NC) {
    int64_t i = 0;
    for (; i + 4 <= nq; i += 4) scores_rows_avx512(s, i, D, 4, NC);
    for (; i < nq; i++) scores_rows_avx512(s, i, D, 1, NC);
}

/* Only the 16-position columns that hold the chunk's `m` keys are computed (a short prompt's, a last chunk's). */
static void scores_avx512(const Scratch *s, int64_t nq, int64_t D, int64_t m) {
    switch ((m + 15) / 16) {
        case 1: scores_nc_avx512(s, nq, D, 1); break;
        case 2: scores_nc_avx512(s, nq, D, 2); break;
        case 3: scores_nc_avx512(s, nq, D, 3); break;
        default: scores_nc_avx512(s, nq, D, 4); break;
    }
}

/* o[i0 .. i0 + R) += p . v over the chunk's m positions; DV = head_dim / 16, R * DV accumulators. */
static inline __attribute__((always_inline)) void values_rows_avx512(
        const Job *job, const Scratch *s, int64_t i0, int64_t m, int64_t kv, const int DV, const int R,
        const int bf16) {
    const int64_t D = (int64_t)DV * 16, KV = job->num_kv_heads;
    __m512 acc[24];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_loadu_ps(s->o + (i0 + r) * D + 16 * c);
    for (int64_t j = 0; j < m; j++) {
        const int64_t base = (s->slots[j] * KV + kv) * D;
        __m512 v[16];
        for (int c = 0; c < DV; c++) v[c] = load16(job->value_cache, base + 16 * c, bf16);
        for (int r = 0; r < R; r++) {
            const __m512 w = _mm512_set1_ps(s->p[(i0 + r) * BK + j]);
            for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_fmadd_ps(w, v[c], acc[r * DV + c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(s->o + (i0 + r) * D + 16 * c, acc[r * DV + c]);
}

/* Query vectors per register block: R * DV accumulators plus DV value registers stay within 32. */
#define VALUES_FOR_DV(DV, R)                                                                            \
    do {                                                                                                \
        int64_t i = 0;                                                                                  \
        for (; i + (R) <= nq; i += (R)) values_rows_avx512(job, s, i, m, kv, DV, R, bf16);              \
        for (; i < nq; i++) values_rows_avx512(job, s, i, m, kv, DV, 1, bf16);                          \
    } while (0)

static inline __attribute__((always_inline)) void values_avx512_b(const Job *job, const Scratch *s, int64_t nq,
                                                                  int64_t m, int64_t kv, const int bf16) {
    switch (job->head_dim / 16) {
        case 1: VALUES_FOR_DV(1, 12); break;
        case 2: VALUES_FOR_DV(2, 8); break;
        case 3: VALUES_FOR_DV(3, 6); break;
        case 4: VALUES_FOR_DV(4, 4); break;
        case 5: VALUES_FOR_DV(5, 3); break;
        case 6: VALUES_FOR_DV(6, 3); break;
        case 7: VALUES_FOR_DV(7, 2); break;
        case 8: VALUES_FOR_DV(8, 2); break;
        default: VALUES_FOR_DV(16, 1); break;  /* head_dim up to 256: simd_serves checked it */
    }
}

static void values_avx512(const Job *job, const Scratch *s, int64_t nq, int64_t m, int64_t kv) {
    if (job->is_bf16) values_avx512_b(job, s, nq, m, kv, 1);
    else values_avx512_b(job, s, nq, m, kv, 0);
}

static int simd_serves(int64_t head_dim) {
    return head_dim % 16 == 0 && head_dim <= 256 && (head_dim <= 128 || head_dim == 256);
}

#if defined(HAVE_BF16_DOT)
/* kt2[w][j] for the chunk's keys j in [0, m): 16 positions x 16 words (32 dimensions) at a time, zero past m. */
static void pair_keys_bf16(const Job *job, const Scratch *s, int64_t m, int64_t kv) {
    const int64_t D = job->head_dim, W = D / 2, KV = job->num_kv_heads;
    const uint16_t *keys = job->key_cache;
    int64_t j0 = 0;
    for (; j0 + 16 <= m; j0 += 16) {
        for (int64_t w0 = 0; w0 < W; w0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(keys + (s->slots[j0 + i] * KV + kv) * D + 2 * w0);
            transpose16(r, (float *)s->kt2 + w0 * BK + j0, BK);
        }
    }
    for (; j0 < m; j0++) {
        const uint32_t *key = (const uint32_t *)(keys + (s->slots[j0] * KV + kv) * D);
        for (int64_t w = 0; w < W; w++) s->kt2[w * BK + j0] = key[w];
    }
    if (m < BK)
        for (int64_t w = 0; w < W; w++) memset(s->kt2 + w * BK + m, 0, sizeof(uint32_t) * (size_t)(BK - m));
}

/* vt2[t][d] for the chunk's position pairs: dimension d of keys 2t and 2t + 1 side by side (a zero row past m). */
static void pair_values_bf16(const Job *job, const Scratch *s, int64_t m, int64_t kv) {
    const int64_t D = job->head_dim, KV = job->num_kv_heads;
    const uint16_t *values = job->value_cache;
    /* unpacklo/hi_epi16 interleave within 128-bit lanes (dimensions 8k..8k+3 | 8k+4..8k+7 of lane k): put the
     * lanes back in dimension order. */
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t t = 0; 2 * t < m; t++) {
        const uint16_t *a = values + (s->slots[2 * t] * KV + kv) * D;
        const uint16_t *b = 2 * t + 1 < m ? values + (s->slots[2 * t + 1] * KV + kv) * D : NULL;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const __m512i x = _mm512_loadu_si512(a + d0), y = b ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
            const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
            _mm512_storeu_si512(s->vt2 + t * D + d0, _mm512_permutex2var_epi64(lo, first, hi));
            _mm512_storeu_si512(s->vt2 + t * D + d0 + 16, _mm512_permutex2var_epi64(lo, second, hi));
        }
    }
}

/* Scores of query vectors [i0, i0 + R) against the chunk's first 16 * NC positions, a word (two dimensions) a step. */
static inline __attribute__((always_inline)) void scores_rows_bf16(const Scratch *s, int64_t i0, int64_t D,
                                                                   const int R, const int NC) {
    const int64_t W = D / 2;
    const uint32_t *q = (const uint32_t *)s->qb;
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t w = 0; w < W; w++) {
        __m512bh kw[4];
        for (int c = 0; c < NC; c++) kw[c] = (__m512bh)_mm512_loadu_si512(s->kt2 + w * BK + 16 * c);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[(i0 + r) * W + w]);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, kw[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(s->p + (i0 + r) * BK + 16 * c, acc[r][c]);
}

static inline __attribute__((always_inline)) void scores_nc_bf16(const Scratch *s, int64_t nq, int64_t D,
                                                                 const int NC) {
    int64_t i = 0;
    for (; i + 4 <= nq; i += 4) scores_rows_bf16(s, i, D, 4, NC);
    for (; i < nq; i++) scores_rows_bf16(s, i, D, 1, NC);
}

static void scores_bf16(const Scratch *s, int64_t nq, int64_t D, int64_t m) {
    switch ((m + 15) / 16) {
        case 1: scores_nc_bf16(s, nq, D, 1); break;
        case 2: scores_nc_bf16(s, nq, D, 2); break;
        case 3: scores_nc_bf16(s, nq, D, 3); break;
        default: scores_nc_bf16(s, nq, D, 4); break;
    }
}

/* o[i0 .. i0 + R) += p . v over the chunk's position pairs; DV = head_dim / 16, R * DV accumulators. */
static inline __attribute__((always_inline)) void values_rows_bf16(const Scratch *s, int64_t i0, int64_t pairs,
                                                                   const int DV, const int R) {
    const int64_t D = (int64_t)DV * 16;
    const uint32_t *p = (const uint32_t *)s->pb;
    __m512 acc[24];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_loadu_ps(s->o + (i0 + r) * D + 16 * c);
    for (int64_t t = 0; t < pairs; t++) {
        __m512bh v[16];
        for (int c = 0; c < DV; c++) v[c] = (__m512bh)_mm512_loadu_si512(s->vt2 + t * D + 16 * c);
        for (int r = 0; r < R; r++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[(i0 + r) * (BK / 2) + t]);
            for (int c = 0; c < DV; c++) acc[r * DV + c] = _mm512_dpbf16_ps(acc[r * DV + c], w, v[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(s->o + (i0 + r) * D + 16 * c, acc[r * DV + c]);
}

#define VALUES_BF16_FOR_DV(DV, R)                                                                       \
    do {                                                                                                \
        int64_t i = 0;                                                                                  \
        for (; i + (R) <= nq; i += (R)) values_rows_bf16(s, i, pairs, DV, R);                           \
        for (; i < nq; i++) values_rows_bf16(s, i, pairs, DV, 1);                                       \
    } while (0)

/* The chunk's probabilities (already bfloat16 values) as bfloat16 bits, its values paired, then the products. */
static void values_bf16(const Job *job, const Scratch *s, int64_t nq, int64_t m, int64_t kv) {
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < BK; j += 32) {
            const __m512bh bits = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s->p + i * BK + j + 16),
                                                      _mm512_loadu_ps(s->p + i * BK + j));
            _mm512_storeu_si512(s->pb + i * BK + j, (__m512i)bits);
        }
    pair_values_bf16(job, s, m, kv);
    const int64_t pairs = (m + 1) / 2;
    switch (job->head_dim / 16) {
        case 2: VALUES_BF16_FOR_DV(2, 8); break;
        case 4: VALUES_BF16_FOR_DV(4, 4); break;
        case 6: VALUES_BF16_FOR_DV(6, 3); break;
        case 8: VALUES_BF16_FOR_DV(8, 2); break;
        default: VALUES_BF16_FOR_DV(16, 1); break;  /* head_dim up to 256: bf16_dot_serves checked it */
    }
}

static int bf16_dot_serves(int64_t head_dim) { return simd_serves(head_dim) && head_dim % 32 == 0; }
#else
static int bf16_dot_serves(int64_t head_dim) { (void)head_dim; return 0; }
#endif
#else
static int simd_serves(int64_t head_dim) { (void)head_dim; return 0; }
static int bf16_dot_serves(int64_t head_dim) { (void)head_dim; return 0; }
#endif

/* x = rnd(x) for n floats: to the nearest bfloat16, ties to even. */
static void round_to_bf16(float *x, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (; j + 16 <= n; j += 16) {
        const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(x + j));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
        const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, half), odd);
        _mm512_storeu_ps(x + j, _mm512_castsi512_ps(_mm512_and_si512(rounded, high)));
    }
#endif
    for (; j < n; j++) x[j] = rnd(x[j], 1);
}

/* ---- one work item ---- */

static void run_item(const Job *job, Scratch *s, int64_t span, int64_t row0, int64_t kv) {
    const int64_t D = job->head_dim, G = job->group, KV = job->num_kv_heads, H = KV * G, bs = job->block_size;
    const int64_t qlen = job->query_len[span], ctx = job->context_len[span], first_pos = ctx - qlen;
    const int64_t rows = qlen - row0 < BQ ? qlen - row0 : BQ, nq = rows * G;
    const int64_t last_pos = first_pos + row0 + rows - 1;  /* the block's last row attends to keys <= it */
    const int64_t window = job->window;
    const int64_t kstart = (window > 0 && first_pos + row0 - window + 1 > 0) ? first_pos + row0 - window + 1 : 0;
    const int64_t nkeys = last_pos + 1 - kstart;
    const int64_t *table = job->block_table + span * job->table_width;
    for (int64_t i = 0; i < nkeys; i++) {
        const int64_t pos = kstart + i;
        s->slots[i] = table[pos / bs] * bs + pos % bs;
    }
    const int64_t qrow0 = job->query_start[span] + row0;
    const int bf16 = job->is_bf16;
    /* float32 scales the queries; bfloat16 (the reference's arithmetic) scales each score. */
    const float q_scale = bf16 ? 1.f : job->scale, score_scale = bf16 ? job->scale : 1.f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < G; h++) {
            const int64_t at = (qrow0 + r) * job->query_row_stride + (kv * G + h) * D;
            if (job->use_bf16_dot) {
                memcpy(s->qb + (r * G + h) * D, (const uint16_t *)job->query + at, sizeof(uint16_t) * (size_t)D);
                continue;
            }
            for (int64_t d = 0; d < D; d++) s->q[(r * G + h) * D + d] = ld(job->query, at + d, bf16) * q_scale;
        }
    memset(s->o, 0, sizeof(float) * (size_t)(nq * D));
    for (int64_t i = 0; i < nq; i++) { s->mx[i] = -FLT_MAX; s->sum[i] = 0.f; }

    for (int64_t c0 = 0; c0 < nkeys; c0 += BK) {
        const int64_t m = nkeys - c0 < BK ? nkeys - c0 : BK, kbase = kstart + c0;
        Scratch chunk = *s;  /* the chunk's slots start at c0 */
        chunk.slots = s->slots + c0;
#if defined(HAVE_BF16_DOT)
        if (job->use_bf16_dot) {
            pair_keys_bf16(job, &chunk, m, kv);
            scores_bf16(s, nq, D, m);
        } else
#endif
        {
#if defined(__AVX512F__)
            if (job->use_simd) transpose_keys_avx512(job, &chunk, m, kv); else
#endif
            for (int64_t j = 0; j < m; j++) {  /* transpose the chunk's keys */
                const int64_t base = (chunk.slots[j] * KV + kv) * D;
                for (int64_t d = 0; d < D; d++) s->kt[d * BK + j] = ld(job->key_cache, base + d, bf16);
            }
            if (m < BK)
                for (int64_t d = 0; d < D; d++) memset(s->kt + d * BK + m, 0, sizeof(float) * (size_t)(BK - m));
#if defined(__AVX512F__)
            if (job->use_simd) scores_avx512(s, nq, D, m); else
#endif
            scores_portable(s, nq, D, m);
        }
        /* Online softmax over each query vector's keys in this chunk: [lo, hi) are those it may attend to. */
        for (int64_t i = 0; i < nq; i++) {
            float *p = s->p + i * BK, *o = s->o + i * D;
            const int64_t pos = first_pos + row0 + i / G;
            int64_t lo = 0, hi = pos - kbase + 1 < m ? pos - kbase + 1 : m;
            if (window > 0 && pos - window + 1 - kbase > 0) lo = pos - window + 1 - kbase;
            if (hi <= lo) {  /* nothing here for this row: its probabilities are 0, its state unchanged */
                memset(p, 0, sizeof(float) * BK);
                continue;
            }
            float cmax = -FLT_MAX;
            for (int64_t j = lo; j < hi; j++) cmax = p[j] > cmax ? p[j] : cmax;
            cmax *= score_scale;  /* positive: the largest scaled score */
            const float mnew = cmax > s->mx[i] ? cmax : s->mx[i];
            const float alpha = expf(s->mx[i] - mnew);
            float add = 0.f;
            for (int64_t j = 0; j < lo; j++) p[j] = 0.f;
            #pragma omp simd reduction(+:add)
            for (int64_t j = lo; j < hi; j++) { p[j] = expf(p[j] * score_scale - mnew); add += p[j]; }
            /* bfloat16 weighs the values by rounded probabilities (the pair dot products round as they convert). */
            if (bf16 && !job->use_bf16_dot) round_to_bf16(p + lo, hi - lo);
            for (int64_t j = hi; j < BK; j++) p[j] = 0.f;
            s->sum[i] = s->sum[i] * alpha + add;
            s->mx[i] = mnew;
            if (alpha != 1.f) {
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] *= alpha;
            }
        }
        /* The chunk's weighted values. */
#if defined(HAVE_BF16_DOT)
        if (job->use_bf16_dot) values_bf16(job, &chunk, nq, m, kv); else
#endif
#if defined(__AVX512F__)
        if (job->use_simd) values_avx512(job, &chunk, nq, m, kv); else
#endif
        values_portable(job, &chunk, nq, m, kv);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < G; h++) {
            const int64_t i = r * G + h;
            const float inv = 1.f / s->sum[i];
            for (int64_t d = 0; d < D; d++)
                st(job->out, ((qrow0 + r) * H + kv * G + h) * D + d, s->o[i * D + d] * inv, bf16);
        }
}

/* The exported functions' parameters, and the same names passed on. */
#define PREFILL_PARAMS                                                                             \
    const void *query, int64_t query_row_stride, const void *key_cache, const void *value_cache,   \
    const int64_t *query_start, const int64_t *query_len, const int64_t *context_len,              \
    const int64_t *block_table, int64_t table_width, int64_t num_spans, int64_t block_size,        \
    int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t window, float scale, void *out, \
    int is_bf16, int num_threads
#define PREFILL_ARGS                                                                               \
    query, query_row_stride, key_cache, value_cache, query_start, query_len, context_len,          \
    block_table, table_width, num_spans, block_size, num_kv_heads, group, head_dim, window, scale, \
    out, is_bf16, num_threads

/* Returns 0, or -1 when scratch memory ran out. */
static int run_jobs(PREFILL_PARAMS, int level) {
    const Job job = {query, query_row_stride, key_cache, value_cache, query_start, query_len, context_len,
                     block_table, table_width, num_spans, block_size, num_kv_heads, group, head_dim, window, scale,
                     out, is_bf16, level >= SIMD_FLOAT && simd_serves(head_dim),
                     level == FASTEST && is_bf16 && bf16_dot_serves(head_dim)};
    /* Items in order of (span, row block, KV head); first_item[s] is span s's first. */
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_spans + 1));
    if (!first_item) return -1;
    int64_t max_keys = 1;
    first_item[0] = 0;
    for (int64_t sp = 0; sp < num_spans; sp++) {
        first_item[sp + 1] = first_item[sp] + (query_len[sp] + BQ - 1) / BQ * num_kv_heads;
        if (context_len[sp] > max_keys) max_keys = context_len[sp];
    }
    const int64_t items = first_item[num_spans], nq = BQ * group, D = head_dim;
    if (num_threads < 1) num_threads = 1;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        /* Float-sized units, an even count (the slots after them are 8-byte aligned); the last four are the
         * pair dot products' (qb, kt2, pb, vt2). */
        const size_t floats = (size_t)(nq * D + D * BK + nq * BK + nq * D + 2 * nq
                                       + (nq * D + 1) / 2 + (D + 1) / 2 * BK + nq * BK / 2 + BK / 2 * D + 1) / 2 * 2;
        float *memory = aligned_alloc(64, (sizeof(float) * floats + sizeof(int64_t) * (size_t)max_keys + 63) / 64 * 64);
        failed |= memory == NULL;
        Scratch s = {0};
        if (memory) {
            s.q = memory;
            s.kt = s.q + nq * D;
            s.p = s.kt + D * BK;
            s.o = s.p + nq * BK;
            s.mx = s.o + nq * D;
            s.sum = s.mx + nq;
            s.qb = (uint16_t *)(s.sum + nq);
            s.kt2 = (uint32_t *)(s.sum + nq + (nq * D + 1) / 2);
            s.pb = (uint16_t *)(s.kt2 + (D + 1) / 2 * BK);
            s.vt2 = (uint32_t *)s.pb + nq * BK / 2;
            s.slots = (int64_t *)(memory + floats);
        }
        int64_t span = 0;
        /* Every thread reaches the loop (a work-sharing loop must be met by all); one without scratch skips
         * its items and the call fails. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!memory) continue;
            if (item < first_item[span]) span = 0;  /* a thread's items only grow; reset if not */
            while (item >= first_item[span + 1]) span++;
            const int64_t local = item - first_item[span];
            run_item(&job, &s, span, local / num_kv_heads * BQ, local % num_kv_heads);
        }
        free(memory);
    }
    free(first_item);
    return failed ? -1 : 0;
}

/* The fastest implementation this build has for the cache's type and `head_dim`. */
int paged_prefill_attention(PREFILL_PARAMS) { return run_jobs(PREFILL_ARGS, FASTEST); }

/* The float AVX-512 implementation where the build has it (never the pair dot products), else the portable one. */
int paged_prefill_attention_simd_float(PREFILL_PARAMS) { return run_jobs(PREFILL_ARGS, SIMD_FLOAT); }

/* The portable implementation alone, whatever the build targets. */
int paged_prefill_attention_portable(PREFILL_PARAMS) { return run_jobs(PREFILL_ARGS, PORTABLE); }
