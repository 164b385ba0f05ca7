/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * For each sequence the kernel reads its keys position by position from the cache
 * (every KV head of a position is one contiguous row, and a block's positions are
 * contiguous, so it streams; no gather into a padded copy), computes every query
 * head's scores, a softmax in float32, and the weighted sum of the values.
 * Sequences are split over `num_threads` threads.
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
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    int64_t first_item, last_item;  /* the sequences [first, last) */
    int failed;
} Job;

/* `n` elements at `offset` as float32: in place for float32, else converted into `scratch`
 * (so the inner loops vectorize on one type). */
static inline const float *as_f32(float *scratch, const void *src, int64_t offset, int64_t n, int is_bf16) {
    if (!is_bf16) return (const float *)src + offset;
    for (int64_t i = 0; i < n; i++) scratch[i] = ld(src, offset + i, 1);
    return scratch;
}

static void run_items(Job *job) {
    const int64_t D = job->head_dim, G = job->group, KV = job->num_kv_heads, H = KV * G, bs = job->block_size;
    int64_t max_len = 0;
    for (int64_t s = 0; s < job->num_seqs; s++) if (job->context_lens[s] > max_len) max_len = job->context_lens[s];
    float *scores = malloc(sizeof(float) * (size_t)(H * max_len + 2 * H * D + KV * D));
    if (!scores) { job->failed = 1; return; }
    float *q = scores + H * max_len, *acc = q + H * D, *row = acc + H * D;
    for (int64_t seq = job->first_item; seq < job->last_item; seq++) {
        const int64_t len = job->context_lens[seq], token = job->token_index[seq];
        const int64_t start = (job->window > 0 && len > job->window) ? len - job->window : 0;
        const int64_t n = len - start;
        const int64_t *table = job->block_table + seq * job->table_width;
        const float *qrow = as_f32(q, job->query, token * job->query_row_stride, H * D, job->is_bf16);
        if (qrow != q) memcpy(q, qrow, sizeof(float) * (size_t)(H * D));
        /* Scores: one position's keys (every KV head, contiguous in the cache) at a time. */
        for (int64_t p = start; p < len; p++) {
            const int64_t slot = table[p / bs] * bs + p % bs;
            const float *keys = as_f32(row, job->key_cache, slot * KV * D, KV * D, job->is_bf16);
            for (int64_t h = 0; h < H; h++) {
                const float *qh = q + h * D, *k = keys + (h / G) * D;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];
                scores[h * max_len + (p - start)] = dot * job->scale;
            }
        }
        /* Softmax per query head. */
        for (int64_t h = 0; h < H; h++) {
            float *sh = scores + h * max_len, mx = -FLT_MAX, sum = 0.f;
            #pragma omp simd reduction(max:mx)
            for (int64_t i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
            #pragma omp simd reduction(+:sum)
            for (int64_t i = 0; i < n; i++) { sh[i] = expf(sh[i] - mx); sum += sh[i]; }
            const float inv = 1.f / sum;
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) sh[i] *= inv;
        }
        /* Weighted values, one position's values at a time. */
        memset(acc, 0, sizeof(float) * (size_t)(H * D));
        for (int64_t p = start; p < len; p++) {
            const int64_t slot = table[p / bs] * bs + p % bs;
            const float *values = as_f32(row, job->value_cache, slot * KV * D, KV * D, job->is_bf16);
            for (int64_t h = 0; h < H; h++) {
                const float w = scores[h * max_len + (p - start)], *v = values + (h / G) * D;
                float *ah = acc + h * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) ah[d] += w * v[d];
            }
        }
        for (int64_t i = 0; i < H * D; i++) st(job->out, token * H * D + i, acc[i], job->is_bf16);
    }
    free(scores);
}

static void *thread_main(void *arg) { run_items((Job *)arg); return NULL; }

int paged_decode_attention(
    const void *query, int64_t query_row_stride, const int64_t *token_index,
    const void *key_cache, const void *value_cache,
    const int64_t *block_table, int64_t table_width, const int64_t *context_lens,
    int64_t num_seqs, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
    int64_t window, float scale, void *out, int is_bf16, int num_threads)
{
    const int64_t items = num_seqs;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = (int)items;
    if (num_threads > 64) num_threads = 64;
    Job jobs[64];
    pthread_t threads[64];
    for (int t = 0; t < num_threads; t++) {
        Job j = {query, query_row_stride, token_index, key_cache, value_cache, block_table, table_width,
                 context_lens, num_seqs, block_size, num_kv_heads, group, head_dim, window, scale, out, is_bf16,
                 items * t / num_threads, items * (t + 1) / num_threads, 0};
        jobs[t] = j;
    }
    int started = 0;
    for (int t = 1; t < num_threads; t++) {
        if (pthread_create(&threads[t], NULL, thread_main, &jobs[t]) != 0) break;
        started = t;
    }
    run_items(&jobs[0]);
    for (int t = started + 1; t < num_threads; t++) run_items(&jobs[t]);  /* threads that failed to start */
    for (int t = 1; t <= started; t++) pthread_join(threads[t], NULL);
    for (int t = 0; t < num_threads; t++) if (jobs[t].failed) return -1;
    return 0;
}
