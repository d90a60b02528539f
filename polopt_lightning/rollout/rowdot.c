/* Few-row float32 products on weights in PyTorch's [out, in] layout, for decoding on CPUs with AVX-512.
 *
 * y_j[m, n] = sum_k x[m, k] * w_j[n, k] (+ b_j[n]) for every weight j of a call (weights that share the input x,
 * e.g. q/k/v), rows m < M (M a multiple of 8: the caller pads), K a multiple of 16.
 *
 * Why: decoding multiplies 8-16 rows by every weight, so each weight element is used 8-16 times and the product is
 * bound by how fast the weights stream from memory. Library kernels (oneDNN, MKL) stream a plain [out, in] weight at
 * about half the rate a plain read reaches, and oneDNN reaches that rate only on a copy reordered into its blocked
 * layout, which costs a reorder of every weight at every rollout (the policy changes between rollouts). This kernel
 * reads the plain layout directly: three weight rows at a time against eight input rows (24 accumulators, each a
 * 16-wide partial dot product summed at the end), and prefetches the weight rows it reaches next, so the loads stay
 * ahead of the arithmetic. Threads (OpenMP) split every weight's rows evenly.
 */
#include <immintrin.h>
#include <omp.h>

#define PREFETCH_FLOATS 16384 /* how far ahead the weight rows are prefetched (64 KiB): measured 16-18 GB/s a thread */

#define FMA3(m) { __m512 xv = _mm512_loadu_ps(xb + (m) * K + k); \
    c##m##0 = _mm512_fmadd_ps(xv, a0, c##m##0); c##m##1 = _mm512_fmadd_ps(xv, a1, c##m##1); \
    c##m##2 = _mm512_fmadd_ps(xv, a2, c##m##2); }
#define ZERO3(m) __m512 c##m##0 = _mm512_setzero_ps(), c##m##1 = _mm512_setzero_ps(), c##m##2 = _mm512_setzero_ps();
#define STORE3(m) { float *o = yb + (m) * ldy + n; o[0] = _mm512_reduce_add_ps(c##m##0) + b0; \
    o[1] = _mm512_reduce_add_ps(c##m##1) + b1; o[2] = _mm512_reduce_add_ps(c##m##2) + b2; }

/* Output rows [n0, n1) of one weight for input rows [0, M). */
static void rows_of(const float *x, long M, long K, const float *w, const float *bias, float *y, long ldy,
                    long n0, long n1) {
    long n = n0;
    for (; n + 3 <= n1; n += 3) {
        const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K;
        float b0 = bias ? bias[n] : 0.f, b1 = bias ? bias[n + 1] : 0.f, b2 = bias ? bias[n + 2] : 0.f;
        for (long m0 = 0; m0 < M; m0 += 8) { /* later row blocks find the three weight rows in L1 */
            const float *xb = x + m0 * K;
            float *yb = y + m0 * ldy;
            ZERO3(0) ZERO3(1) ZERO3(2) ZERO3(3) ZERO3(4) ZERO3(5) ZERO3(6) ZERO3(7)
            for (long k = 0; k < K; k += 16) {
                const char *ahead = (const char *)(w0 + 3 * K + PREFETCH_FLOATS) + 3 * 4 * k;
                _mm_prefetch(ahead, _MM_HINT_T0);
                _mm_prefetch(ahead + 64, _MM_HINT_T0);
                _mm_prefetch(ahead + 128, _MM_HINT_T0);
                __m512 a0 = _mm512_loadu_ps(w0 + k), a1 = _mm512_loadu_ps(w1 + k), a2 = _mm512_loadu_ps(w2 + k);
                FMA3(0) FMA3(1) FMA3(2) FMA3(3) FMA3(4) FMA3(5) FMA3(6) FMA3(7)
            }
            STORE3(0) STORE3(1) STORE3(2) STORE3(3) STORE3(4) STORE3(5) STORE3(6) STORE3(7)
        }
    }
    for (; n < n1; n++) { /* at most two rows left */
        for (long m = 0; m < M; m++) {
            __m512 acc = _mm512_setzero_ps();
            for (long k = 0; k < K; k += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), _mm512_loadu_ps(w + n * K + k), acc);
            y[m * ldy + n] = _mm512_reduce_add_ps(acc) + (bias ? bias[n] : 0.f);
        }
    }
}

/* count weights sharing x [M, K]: weights[j] [outs[j], K], biases[j] (or NULL), outputs[j] [M, outs[j]]. */
void polopt_rowdot(const float *x, long M, long K, int count, const float *const *weights,
                   const float *const *biases, float *const *outputs, const long *outs, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int j = 0; j < count; j++) {
            long N = outs[j], n0 = (N * t / nt) / 3 * 3, n1 = t == nt - 1 ? N : (N * (t + 1) / nt) / 3 * 3;
            rows_of(x, M, K, weights[j], biases[j], outputs[j], N, n0, n1);
        }
    }
}
