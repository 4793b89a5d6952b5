/* The read ceiling for benchmarks/cpu_matmul_b1.py: sum every float of a list of weights with
 * AVX-512 loads, split between `threads` threads (the caller is one), each thread taking its
 * share of every weight in turn, as a GEMV split over N would. Four accumulators so that the
 * adds never wait on one another: the loop is bound by the loads alone. */
#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>

typedef struct {
    const float *const *weights;
    size_t count, floats;  /* weights, floats in each (a multiple of 64) */
    int part, parts;
    float sum;
} share_t;

static void *read_share(void *arg) {
    share_t *s = arg;
    size_t lines = s->floats / 64, per = (lines + s->parts - 1) / s->parts;
    size_t start = per * s->part * 64, end = per * (s->part + 1) * 64;
    if (end > s->floats) end = s->floats;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t w = 0; w < s->count; w++) {
        const float *b = s->weights[w];
        for (size_t i = start; i < end; i += 64) {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(b + i));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(b + i + 16));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(b + i + 32));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps(b + i + 48));
        }
    }
    s->sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    return NULL;
}

float read_weights(const float *const *weights, size_t count, size_t floats, int threads) {
    share_t shares[16];
    pthread_t ids[16];
    if (threads < 1) threads = 1;
    if (threads > 16) threads = 16;
    for (int t = 0; t < threads; t++)
        shares[t] = (share_t){weights, count, floats, t, threads, 0.0f};
    for (int t = 1; t < threads; t++) pthread_create(&ids[t], NULL, read_share, &shares[t]);
    read_share(&shares[0]);
    float total = shares[0].sum;
    for (int t = 1; t < threads; t++) {
        pthread_join(ids[t], NULL);
        total += shares[t].sum;
    }
    return total;
}
