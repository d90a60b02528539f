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
#include <math.h>
#include <omp.h>
#include <stddef.h>

#define PREFETCH_FLOATS 16384 /* how far ahead the weight rows are prefetched (64 KiB; without: 28-30 GB/s against 33-36,
                                  2 threads; other distances and hints alike) */

/* The empty asm keeps each input vector in a register for its three products: without it GCC folds the load into each
 * product (24 loads an iteration instead of 11), and the loads, not the products, set the pace (hot in cache: 75
 * against 95 GB/s; from memory 33 against 35.5 GB/s; the same sums, bit for bit). */
#define FMA3(m) { __m512 xv = _mm512_loadu_ps(xb + (m) * K + k); __asm__("" : "+v"(xv)); \
    c##m##0 = _mm512_fmadd_ps(xv, a0, c##m##0); c##m##1 = _mm512_fmadd_ps(xv, a1, c##m##1); \
    c##m##2 = _mm512_fmadd_ps(xv, a2, c##m##2); }
#define ZERO3(m) __m512 c##m##0 = _mm512_setzero_ps(), c##m##1 = _mm512_setzero_ps(), c##m##2 = _mm512_setzero_ps();
#define STORE3(m) { float *o = yb + (m) * ldy + n; o[0] = _mm512_reduce_add_ps(c##m##0) + b0; \
    o[1] = _mm512_reduce_add_ps(c##m##1) + b1; o[2] = _mm512_reduce_add_ps(c##m##2) + b2; }

/* Output rows n, n+1, n+2 (weight rows w0, w1, w2) for input rows [0, M); with `prefetch` (a constant where it is
 * inlined), the weights read next are prefetched from `ahead` on (3 lines an iteration). */
static inline __attribute__((always_inline)) void three_rows(const float *x, long M, long K, const float *w0,
                                                             const float *w1, const float *w2, const float *bias,
                                                             long n, float *y, long ldy, int prefetch,
                                                             const char *ahead) {
    float b0 = bias ? bias[n] : 0.f, b1 = bias ? bias[n + 1] : 0.f, b2 = bias ? bias[n + 2] : 0.f;
    for (long m0 = 0; m0 < M; m0 += 8) { /* later row blocks find the three weight rows in L1 */
        const float *xb = x + m0 * K;
        float *yb = y + m0 * ldy;
        ZERO3(0) ZERO3(1) ZERO3(2) ZERO3(3) ZERO3(4) ZERO3(5) ZERO3(6) ZERO3(7)
        for (long k = 0; k < K; k += 16) {
            if (prefetch) {
                _mm_prefetch(ahead + 3 * 4 * k, _MM_HINT_T0);
                _mm_prefetch(ahead + 3 * 4 * k + 64, _MM_HINT_T0);
                _mm_prefetch(ahead + 3 * 4 * k + 128, _MM_HINT_T0);
            }
            __m512 a0 = _mm512_loadu_ps(w0 + k), a1 = _mm512_loadu_ps(w1 + k), a2 = _mm512_loadu_ps(w2 + k);
            FMA3(0) FMA3(1) FMA3(2) FMA3(3) FMA3(4) FMA3(5) FMA3(6) FMA3(7)
        }
        STORE3(0) STORE3(1) STORE3(2) STORE3(3) STORE3(4) STORE3(5) STORE3(6) STORE3(7)
    }
}

/* Output row n (weight row wn) for input rows [0, M) */
static void one_row(const float *x, long M, long K, const float *wn, const float *bias, long n, float *y, long ldy) {
    for (long m = 0; m < M; m++) {
        __m512 acc = _mm512_setzero_ps();
        for (long k = 0; k < K; k += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), _mm512_loadu_ps(wn + k), acc);
        y[m * ldy + n] = _mm512_reduce_add_ps(acc) + (bias ? bias[n] : 0.f);
    }
}

/* Output rows [n0, n1) of one weight for input rows [0, M). */
static void rows_of(const float *x, long M, long K, const float *w, const float *bias, float *y, long ldy,
                    long n0, long n1) {
    long n = n0;
    for (; n + 3 <= n1; n += 3) {
        const float *w0 = w + n * K;
        three_rows(x, M, K, w0, w0 + K, w0 + 2 * K, bias, n, y, ldy, 1, (const char *)(w0 + 3 * K + PREFETCH_FLOATS));
    }
    for (; n < n1; n++) one_row(x, M, K, w + n * K, bias, n, y, ldy); /* at most two rows left */
}

/* ---- 4-bit weights (bitsandbytes' nf4/fp4 layout) ------------------------------------------------------------------
 * codes: two 4-bit codes a byte over the weight [N, K] flattened, the first in the high half; absmax: one float32 scale
 * a block of `blocksize` consecutive codes (nested scales dequantized by the caller); table: the 16 values a code
 * stands for. A weight is table[code] * absmax[block], as bitsandbytes dequantizes it. Each thread dequantizes a
 * chunk of its rows (~192 KiB of float32) into a buffer in L2 and runs the float32 loop on it, eight input rows at
 * a time (they stay in L1; at 64 rows, three weight rows at a time against every input row read from L2: 217
 * against 292 GFLOP/s). */
static void dequantize_row(const unsigned char *codes, const float *absmax, __m512 table, long blocksize, long K,
                           long n, float *out) {
    const __m128i low = _mm_set1_epi8(0x0F);
    long f0 = n * K;
    for (long k = 0; k < K; k += 16) {
        const unsigned char *c = codes + (f0 + k) / 2;
        if (!(k & 127)) _mm_prefetch((const char *)c + 4096, _MM_HINT_T0);
        __m128i b = _mm_loadl_epi64((const __m128i *)c);
        __m128i idx = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
        __m512 w = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(idx), table);
        _mm512_storeu_ps(out + k, _mm512_mul_ps(w, _mm512_set1_ps(absmax[(f0 + k) / blocksize])));
    }
}

/* buf: chunk_bytes / 4 + 3 * K floats (the chunk's rows, a multiple of 3, at least 3) */
static void rows_of_4bit(const float *x, long M, long K, const unsigned char *codes, const float *absmax,
                         const float *table, long blocksize, const float *bias, float *y, long ldy, long n0, long n1,
                         float *buf, long chunk_bytes) {
    __m512 t = _mm512_loadu_ps(table);
    long chunk = chunk_bytes / (4 * K) / 3 * 3;
    if (chunk < 3) chunk = 3;
    for (long c0 = n0; c0 < n1; c0 += chunk) { /* `chunk` rows (a multiple of 3) dequantized into buf, in L2 */
        long c1 = c0 + chunk < n1 ? c0 + chunk : n1;
        for (long n = c0; n < c1; n++) dequantize_row(codes, absmax, t, blocksize, K, n, buf + (n - c0) * K);
        for (long m0 = 0; m0 < M; m0 += 8) { /* 8 input rows (in L1) against every row of the chunk */
            const float *xb = x + m0 * K;
            float *yb = y + m0 * ldy;
            long n = c0;
            for (; n + 3 <= c1; n += 3) {
                const float *w0 = buf + (n - c0) * K;
                three_rows(xb, 8, K, w0, w0 + K, w0 + 2 * K, bias, n, yb, ldy, 0, NULL);
            }
            for (; n < c1; n++) one_row(xb, 8, K, buf + (n - c0) * K, bias, n, yb, ldy);
        }
    }
}

/* This thread's output rows [n0, n1) of a weight of N rows, in whole blocks of three but the last thread's. */
static void share(long N, int t, int nt, long *n0, long *n1) {
    *n0 = (N * t / nt) / 3 * 3;
    *n1 = t == nt - 1 ? N : (N * (t + 1) / nt) / 3 * 3;
}

/* count weights sharing x [M, K]: weights[j] [outs[j], K], biases[j] (or NULL), outputs[j] [M, outs[j]]. */
void polopt_rowdot(const float *x, long M, long K, int count, const float *const *weights,
                   const float *const *biases, float *const *outputs, const long *outs, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int j = 0; j < count; j++) {
            long n0, n1;
            share(outs[j], t, nt, &n0, &n1);
            rows_of(x, M, K, weights[j], biases[j], outputs[j], outs[j], n0, n1);
        }
    }
}

/* polopt_rowdot on 4-bit weights: codes[j], absmax[j], tables[j] as rows_of_4bit takes them; K and blocksize
 * multiples of 16 (16 consecutive codes share a scale); scratch: `stride` floats a thread, as rows_of_4bit's buf. */
void polopt_rowdot_4bit(const float *x, long M, long K, int count, const unsigned char *const *codes,
                        const float *const *absmax, const float *const *tables, long blocksize,
                        const float *const *biases, float *const *outputs, const long *outs, int threads,
                        float *scratch, long stride, long chunk_bytes) {
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int j = 0; j < count; j++) {
            long n0, n1;
            share(outs[j], t, nt, &n0, &n1);
            rows_of_4bit(x, M, K, codes[j], absmax[j], tables[j], blocksize, biases[j], outputs[j], outs[j], n0, n1,
                         scratch + (long)t * stride, chunk_bytes);
        }
    }
}

/* ---- The whole decoding step of a Llama-family model in one call (polopt_decode_step) ----------------------------
 *
 * Between the step's 97 products (Qwen2.5-0.5B shape) PyTorch runs ~50 small operations a layer (norms, rotary,
 * attention, activation, residuals) at several microseconds each, ~10 ms a token. Here they run between the products
 * inside one OpenMP region, on the same threads, separated by barriers: the products split every weight's rows
 * between the threads as polopt_rowdot does, the rest splits rows (or row x key/value head pairs for attention). */

/* exp on 16 lanes: Cephes' single-precision polynomial after reduction by ln 2 (within ~2 ulp) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

typedef struct {
    long M, N, H, I, heads, kv_heads, D, layers, V; /* rows (padded, a multiple of 8), real rows, widths, head size */
    float eps, scale;
    /* per layer (arrays of `layers` pointers; biases may be NULL) */
    const float *const *in_norm, *const *post_norm, *const *wq, *const *wk, *const *wv, *const *bq, *const *bk,
        *const *bv, *const *wo, *const *bo, *const *wg, *const *wu, *const *wd;
    const float *final_norm, *head; /* [H], [V, H] */
    /* keys/values: segment A (a prompt shared by `a_group` consecutive rows, or each row's own cache with a_group 1),
     * then segment B (each row's completion; b_len 0: none). Strides in floats; the key mask is additive, one row of
     * it per A segment. The new key/value is written at `slot` of A (write_b 0) or of B (write_b 1). */
    float *const *ka, *const *va, *const *kb, *const *vb;
    long a_group, a_row, a_head, a_len, b_row, b_head, b_len, slot, bias_row;
    int write_b;
    const float *a_bias;
    const float *cos, *sin; /* [N, D]: rotary tables at each row's position */
    float *x, *h, *q, *k, *v, *att, *gate, *up, *tmp, *scores, *logits; /* scratch; scores: [threads, a_len+b_len] */
    /* LoRA adapters (NULL: none): per layer and projection (index layer * 7 + q, k, v, o, gate, up, down), A [r, in],
     * B transposed [r, out], scaling and rank r; lora_t: scratch [threads, M, lora_rmax] */
    const float *const *lora_a, *const *lora_bt;
    const float *lora_scale;
    const long *lora_rank;
    long lora_rmax;
    float *lora_t;
    /* 4-bit bases (NULL: none): per layer and projection as lora_a, the float32 block scales and the 16-entry table
     * where that projection's weight pointer holds bitsandbytes' 4-bit codes (rows_of_4bit); one block size;
     * four_buf: scratch [threads, four_stride], rows_of_4bit's buf for the widest input */
    const float *const *four_absmax, *const *four_table;
    long four_blocksize, four_chunk_bytes, four_stride;
    float *four_buf;
} Step;

/* Step's layout as this compiler lays it out, for rowdot.py to compare with its ctypes mirror before the first call
 * (a field added, moved or retyped on one side only would otherwise corrupt memory silently): every field in order. */
#define STEP_FIELDS(X) X(M) X(N) X(H) X(I) X(heads) X(kv_heads) X(D) X(layers) X(V) X(eps) X(scale) X(in_norm) \
    X(post_norm) X(wq) X(wk) X(wv) X(bq) X(bk) X(bv) X(wo) X(bo) X(wg) X(wu) X(wd) X(final_norm) X(head) X(ka) X(va) \
    X(kb) X(vb) X(a_group) X(a_row) X(a_head) X(a_len) X(b_row) X(b_head) X(b_len) X(slot) X(bias_row) X(write_b) \
    X(a_bias) X(cos) X(sin) X(x) X(h) X(q) X(k) X(v) X(att) X(gate) X(up) X(tmp) X(scores) X(logits) X(lora_a) \
    X(lora_bt) X(lora_scale) X(lora_rank) X(lora_rmax) X(lora_t) X(four_absmax) X(four_table) X(four_blocksize) \
    X(four_chunk_bytes) X(four_stride) X(four_buf)
#define STEP_PLACE(f) (long)offsetof(Step, f), (long)sizeof(((Step *)0)->f),
#define STEP_NAME(f) #f ","

/* The field names, comma-separated, in order. */
const char *polopt_step_fields(void) { return STEP_FIELDS(STEP_NAME); }

/* sizeof(Step), then each field's offset and size in the order of polopt_step_fields; writes at most `capacity`
 * numbers and returns how many there are. */
long polopt_step_layout(long *out, long capacity) {
    const long layout[] = {(long)sizeof(Step), STEP_FIELDS(STEP_PLACE)};
    const long n = (long)(sizeof(layout) / sizeof(layout[0]));
    for (long i = 0; i < n && i < capacity; i++) out[i] = layout[i];
    return n;
}

enum { P_Q, P_K, P_V, P_O, P_GATE, P_UP, P_DOWN, PROJECTIONS };

/* This thread's output rows of y = x w^T (+ b), then LoRA's B(A(x)) * scaling added where projection `which` of layer
 * L has an adapter: each thread computes A(x) for every row (r x K per row: small) and adds B's part to its own
 * output rows, vectorized over them on B transposed. */
static void product(const Step *s, const float *x, long K, const float *w, const float *b, float *y, long N, int t,
                    int nt, long L, int which) {
    long n0, n1, i = L * PROJECTIONS + which;
    share(N, t, nt, &n0, &n1);
    if (which >= 0 && s->four_absmax && s->four_absmax[i]) {
        rows_of_4bit(x, s->M, K, (const unsigned char *)w, s->four_absmax[i], s->four_table[i], s->four_blocksize, b,
                     y, N, n0, n1, s->four_buf + (long)t * s->four_stride, s->four_chunk_bytes);
    } else {
        rows_of(x, s->M, K, w, b, y, N, n0, n1);
    }
    if (which < 0 || !s->lora_a || !s->lora_a[i]) return;
    long r = s->lora_rank[i];
    const float *bt = s->lora_bt[i];
    float *ax = s->lora_t + (long)t * s->M * s->lora_rmax; /* [M, r] */
    rows_of(x, s->M, K, s->lora_a[i], NULL, ax, r, 0, r);
    __m512 scale = _mm512_set1_ps(s->lora_scale[i]);
    for (long m = 0; m < s->N; m++) {
        const float *am = ax + m * r;
        float *ym = y + m * N;
        for (long n = n0; n < n1; n += 16) {
            __mmask16 k = n1 - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n1 - n)) - 1);
            __m512 acc = _mm512_setzero_ps();
            for (long j = 0; j < r; j++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(am[j]), _mm512_maskz_loadu_ps(k, bt + j * N + n), acc);
            _mm512_mask_storeu_ps(ym + n, k, _mm512_fmadd_ps(acc, scale, _mm512_maskz_loadu_ps(k, ym + n)));
        }
    }
}

/* out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps) for rows [r0, r1) */
static void rms_rows(const float *x, const float *weight, float *out, long H, float eps, long r0, long r1) {
    for (long r = r0; r < r1; r++) {
        const float *xr = x + r * H;
        __m512 acc = _mm512_setzero_ps();
        for (long i = 0; i < H; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        __m512 f = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)H + eps));
        for (long i = 0; i < H; i += 16)
            _mm512_storeu_ps(out + r * H + i,
                             _mm512_mul_ps(_mm512_loadu_ps(weight + i), _mm512_mul_ps(_mm512_loadu_ps(xr + i), f)));
    }
}

/* x[r] += d[r] for rows [r0, r1) */
static void add_rows(float *x, const float *d, long H, long r0, long r1) {
    for (long i = r0 * H; i < r1 * H; i++) x[i] += d[i];
}

/* x*cos + rotate_half(x)*sin on one head vector of D floats, in place */
static void rope(float *x, const float *cos, const float *sin, long D) {
    long half = D / 2;
    float tmp[512];
    for (long i = 0; i < half; i++) {
        tmp[i] = x[i] * cos[i] - x[i + half] * sin[i];
        tmp[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
    for (long i = 0; i < D; i++) x[i] = tmp[i];
}

static float dot16(const float *a, const float *b, long D) {
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

/* lane j of the result: the sum of a[j]'s 16 lanes (four rounds of shuffles and adds instead of 16 reductions) */
static inline __attribute__((always_inline)) __m512 sums16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* halves: a[2i]'s 8 partial sums, a[2i+1]'s */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane l: a[4i+l]'s 4 partial sums */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* lane l: 2 partial sums of a[8i+l], then of a[8i+4+l] */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    /* e[4l + m] holds a[l + 4m]'s sum: back in order */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), e);
}

/* out[qi * n + j] = q_qi . k_j * scale (+ bias[j]) for `rep` queries (D floats apart) and keys j < len (D floats
 * apart). Sixteen keys at a time: they are read from memory once and from L1 by the other queries of their group. */
static void scores_of(const float *q, long rep, long D, const float *k, long len, float scale, const float *bias,
                      float *out, long n) {
    const __m512 sv = _mm512_set1_ps(scale);
    long j = 0;
    for (; j + 16 <= len; j += 16)
        for (long qi = 0; qi < rep; qi++) {
            __m512 acc[16];
            for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
            for (long i = 0; i < D; i += 16) {
                __m512 qv = _mm512_loadu_ps(q + qi * D + i);
                for (int u = 0; u < 16; u++) acc[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (j + u) * D + i), acc[u]);
            }
            __m512 y = _mm512_mul_ps(sums16(acc), sv);
            if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + j));
            _mm512_storeu_ps(out + qi * n + j, y);
        }
    for (; j < len; j++)
        for (long qi = 0; qi < rep; qi++)
            out[qi * n + j] = dot16(q + qi * D, k + j * D, D) * scale + (bias ? bias[j] : 0.f);
}

/* softmax of row[0..n) in place; returns 1 / the sum of its exponentials (the row is left unnormalised) */
static float softmax_row(float *row, long n) {
    float mx = row[0];
    for (long j = 1; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    __m512 total = _mm512_setzero_ps(), m = _mm512_set1_ps(mx);
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
        _mm512_storeu_ps(row + j, e);
        total = _mm512_add_ps(total, e);
    }
    if (j < n) {
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), m));
        _mm512_mask_storeu_ps(row + j, k, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, e));
    }
    return 1.0f / _mm512_reduce_add_ps(total);
}

/* out[qi * D + ...] += sum_j w[qi * n + j] * v_j over keys j < len (D floats apart), for QN queries (a constant where
 * it is inlined: the accumulators stay in registers). Blocks of 64 keys (16 KiB at D = 64): each chunk of 16 floats
 * of a block's values is read from memory once for the QN queries, its other chunks from L1. */
static inline __attribute__((always_inline)) void weigh(const float *w, long n, const float *v, long len, long D,
                                                         float *out, int QN) {
    for (long j0 = 0; j0 < len; j0 += 64) {
        long j1 = j0 + 64 < len ? j0 + 64 : len;
        for (long i = 0; i < D; i += 16) {
            __m512 acc[8];
            for (int qi = 0; qi < QN; qi++) acc[qi] = _mm512_loadu_ps(out + qi * D + i);
            for (long j = j0; j < j1; j++) {
                __m512 x = _mm512_loadu_ps(v + j * D + i);
                for (int qi = 0; qi < QN; qi++) acc[qi] = _mm512_fmadd_ps(_mm512_set1_ps(w[qi * n + j]), x, acc[qi]);
            }
            for (int qi = 0; qi < QN; qi++) _mm512_storeu_ps(out + qi * D + i, acc[qi]);
        }
    }
}

static inline __attribute__((always_inline)) void values_of(const Step *s, const float *w, long n, const float *va,
                                                             const float *vb, const float *inv, float *out, int QN) {
    long D = s->D;
    for (long i = 0; i < QN * D; i++) out[i] = 0.f;
    weigh(w, n, va, s->a_len, D, out, QN);
    if (s->b_len) weigh(w + s->a_len, n, vb, s->b_len, D, out, QN);
    for (int qi = 0; qi < QN; qi++)
        for (long i = 0; i < D; i += 16)
            _mm512_storeu_ps(out + qi * D + i, _mm512_mul_ps(_mm512_loadu_ps(out + qi * D + i), _mm512_set1_ps(inv[qi])));
}

/* the query heads of one key/value head of one row over segment A then B: att = softmax(q.k * scale + bias) @ v.
 * Each key and value is read once for the group's queries (grouped-query attention), not once per query head. */
static void attend(const Step *s, int layer, long r, long kvh, float *sc) {
    long D = s->D, rep = s->heads / s->kv_heads, n = s->a_len + s->b_len, h0 = kvh * rep;
    const float *q = s->q + r * s->heads * D + h0 * D;
    long g = r / s->a_group;
    const float *ka = s->ka[layer] + g * s->a_row + kvh * s->a_head;
    const float *va = s->va[layer] + g * s->a_row + kvh * s->a_head;
    const float *kb = NULL, *vb = NULL;
    scores_of(q, rep, D, ka, s->a_len, s->scale, s->a_bias + g * s->bias_row, sc, n);
    if (s->b_len) {
        kb = s->kb[layer] + r * s->b_row + kvh * s->b_head;
        vb = s->vb[layer] + r * s->b_row + kvh * s->b_head;
        scores_of(q, rep, D, kb, s->b_len, s->scale, NULL, sc + s->a_len, n);
    }
    float inv[8];
    float *out = s->att + r * s->heads * D + h0 * D;
    for (long q0 = 0; q0 < rep; q0 += 8) {
        int qn = rep - q0 < 8 ? (int)(rep - q0) : 8;
        for (int qi = 0; qi < qn; qi++) inv[qi] = softmax_row(sc + (q0 + qi) * n, n);
        const float *w = sc + q0 * n;
        float *o = out + q0 * D;
        switch (qn) { /* constant counts: each case's accumulators in registers */
            case 1: values_of(s, w, n, va, vb, inv, o, 1); break;
            case 2: values_of(s, w, n, va, vb, inv, o, 2); break;
            case 3: values_of(s, w, n, va, vb, inv, o, 3); break;
            case 4: values_of(s, w, n, va, vb, inv, o, 4); break;
            case 5: values_of(s, w, n, va, vb, inv, o, 5); break;
            case 6: values_of(s, w, n, va, vb, inv, o, 6); break;
            case 7: values_of(s, w, n, va, vb, inv, o, 7); break;
            default: values_of(s, w, n, va, vb, inv, o, 8); break;
        }
    }
}

void polopt_decode_step(const Step *s, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long M = s->M, H = s->H, D = s->D, QW = s->heads * D, KW = s->kv_heads * D;
        long r0 = M * t / nt, r1 = M * (t + 1) / nt;
        long pairs = s->N * s->kv_heads, p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt; /* row x key/value head */
        float *sc = s->scores + (long)t * (s->heads / s->kv_heads) * (s->a_len + s->b_len);
        for (long L = 0; L < s->layers; L++) {
            rms_rows(s->x, s->in_norm[L], s->h, H, s->eps, r0, r1);
            #pragma omp barrier
            product(s, s->h, H, s->wq[L], s->bq[L], s->q, QW, t, nt, L, P_Q);
            product(s, s->h, H, s->wk[L], s->bk[L], s->k, KW, t, nt, L, P_K);
            product(s, s->h, H, s->wv[L], s->bv[L], s->v, KW, t, nt, L, P_V);
            #pragma omp barrier
            for (long r = r0; r < r1 && r < s->N; r++) { /* rotary on q and k; the new key/value into the cache */
                const float *c = s->cos + r * D, *sn = s->sin + r * D;
                for (long h = 0; h < s->heads; h++) rope(s->q + r * QW + h * D, c, sn, D);
                for (long h = 0; h < s->kv_heads; h++) {
                    float *kr = s->k + r * KW + h * D;
                    rope(kr, c, sn, D);
                    float *kd, *vd;
                    if (s->write_b) {
                        kd = s->kb[L] + r * s->b_row + h * s->b_head + s->slot * D;
                        vd = s->vb[L] + r * s->b_row + h * s->b_head + s->slot * D;
                    } else { /* each row's own cache: a_group is 1 */
                        kd = s->ka[L] + r * s->a_row + h * s->a_head + s->slot * D;
                        vd = s->va[L] + r * s->a_row + h * s->a_head + s->slot * D;
                    }
                    for (long i = 0; i < D; i++) { kd[i] = kr[i]; vd[i] = s->v[r * KW + h * D + i]; }
                }
            }
            #pragma omp barrier
            for (long p = p0; p < p1; p++) attend(s, (int)L, p / s->kv_heads, p % s->kv_heads, sc);
            for (long r = r0 > s->N ? r0 : s->N; r < r1; r++) /* padding rows attend to nothing */
                for (long i = 0; i < QW; i++) s->att[r * QW + i] = 0.f;
            #pragma omp barrier
            product(s, s->att, QW, s->wo[L], s->bo[L], s->tmp, H, t, nt, L, P_O);
            #pragma omp barrier
            add_rows(s->x, s->tmp, H, r0, r1);
            rms_rows(s->x, s->post_norm[L], s->h, H, s->eps, r0, r1);
            #pragma omp barrier
            product(s, s->h, H, s->wg[L], NULL, s->gate, s->I, t, nt, L, P_GATE);
            product(s, s->h, H, s->wu[L], NULL, s->up, s->I, t, nt, L, P_UP);
            #pragma omp barrier
            for (long r = r0; r < r1; r++) /* silu(gate) * up, into gate */
                for (long i = 0; i < s->I; i += 16) {
                    __m512 g = _mm512_loadu_ps(s->gate + r * s->I + i);
                    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                    __m512 a = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                    _mm512_storeu_ps(s->gate + r * s->I + i, _mm512_mul_ps(a, _mm512_loadu_ps(s->up + r * s->I + i)));
                }
            #pragma omp barrier
            product(s, s->gate, s->I, s->wd[L], NULL, s->tmp, H, t, nt, L, P_DOWN);
            #pragma omp barrier
            add_rows(s->x, s->tmp, H, r0, r1);
            #pragma omp barrier
        }
        rms_rows(s->x, s->final_norm, s->h, H, s->eps, r0, r1);
        #pragma omp barrier
        product(s, s->h, H, s->head, NULL, s->logits, s->V, t, nt, 0, -1);
    }
}
