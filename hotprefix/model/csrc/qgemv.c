/* Matrix products straight from GGUF weight blocks (Q4_0, Q4_1, Q8_0), for the
 * small-M products of decoding: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * Each 32-weight block is dequantized in registers to float32 exactly as
 * gguf's dequantize() does (w = d * q + m, d and m from fp16), then multiplied
 * with float32 activations: the result is the float32 product with the
 * dequantized weights, up to the order of the additions, while reading 5-6x
 * fewer weight bytes than float32 weights. Rows of W are split over OpenMP
 * threads. Built at first use with -march=native (AVX-512, AVX2 or scalar).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define MAX_M 16

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else { exp = 127 - 15 + 1; while (!(mant & 0x400)) { mant <<= 1; exp--; } mant &= 0x3ff; bits = sign | (exp << 23) | (mant << 13); }
    } else if (exp == 31) { bits = sign | 0x7f800000 | (mant << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (mant << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

static inline int block_bytes(int qtype) {
    return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q8_0 ? 34 : 0;
}

/* The 32 weights of one block, as float32, into w[32]. */
static inline void dequant_block(int qtype, const uint8_t *b, float *w) {
    uint16_t dh; memcpy(&dh, b, 2);
    const float d = fp16_to_fp32(dh);
    if (qtype == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) w[j] = d * (float)q[j];
    } else if (qtype == Q4_1) {
        uint16_t mh; memcpy(&mh, b + 2, 2);
        const float m = fp16_to_fp32(mh);
        const uint8_t *q = b + 4;
        for (int j = 0; j < QK / 2; j++) { w[j] = d * (float)(q[j] & 0x0f) + m; w[j + 16] = d * (float)(q[j] >> 4) + m; }
    } else {
        const uint8_t *q = b + 2;
        for (int j = 0; j < QK / 2; j++) { w[j] = d * (float)((q[j] & 0x0f) - 8); w[j + 16] = d * (float)((q[j] >> 4) - 8); }
    }
}

#if defined(__AVX512F__)
/* One block as two 16-float vectors. */
static inline void dequant_block_v(int qtype, const uint8_t *b, __m512 *lo, __m512 *hi) {
    uint16_t dh; memcpy(&dh, b, 2);
    const __m512 d = _mm512_set1_ps(fp16_to_fp32(dh));
    if (qtype == Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    const uint8_t *qs = b + (qtype == Q4_1 ? 4 : 2);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    const __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
    const __m512 h = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
    if (qtype == Q4_1) {
        uint16_t mh; memcpy(&mh, b + 2, 2);
        const __m512 m = _mm512_set1_ps(fp16_to_fp32(mh));
        *lo = _mm512_add_ps(_mm512_mul_ps(d, l), m);
        *hi = _mm512_add_ps(_mm512_mul_ps(d, h), m);
    } else {
        const __m512 eight = _mm512_set1_ps(8.0f);
        *lo = _mm512_mul_ps(d, _mm512_sub_ps(l, eight));
        *hi = _mm512_mul_ps(d, _mm512_sub_ps(h, eight));
    }
}
#elif defined(__AVX2__)
static inline __m256 cvt8(__m128i bytes8, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

/* One block as four 8-float vectors. */
static inline void dequant_block_v(int qtype, const uint8_t *b, __m256 *v) {
    uint16_t dh; memcpy(&dh, b, 2);
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(dh));
    if (qtype == Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        v[0] = _mm256_mul_ps(d, cvt8(q0, 1));
        v[1] = _mm256_mul_ps(d, cvt8(_mm_srli_si128(q0, 8), 1));
        v[2] = _mm256_mul_ps(d, cvt8(q1, 1));
        v[3] = _mm256_mul_ps(d, cvt8(_mm_srli_si128(q1, 8), 1));
        return;
    }
    const uint8_t *qs = b + (qtype == Q4_1 ? 4 : 2);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    const __m128i l = _mm_and_si128(q, mask), h = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    __m256 f[4] = {cvt8(l, 0), cvt8(_mm_srli_si128(l, 8), 0), cvt8(h, 0), cvt8(_mm_srli_si128(h, 8), 0)};
    if (qtype == Q4_1) {
        uint16_t mh; memcpy(&mh, b + 2, 2);
        const __m256 m = _mm256_set1_ps(fp16_to_fp32(mh));
        for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(_mm256_mul_ps(d, f[i]), m);
    } else {
        const __m256 eight = _mm256_set1_ps(8.0f);
        for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(d, _mm256_sub_ps(f[i], eight));
    }
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Rows n0..n1 of W against up to MAX_M rows of x. */
static void rows(int qtype, const float *x, int M, int K, const uint8_t *w, int n0, int n1, float *y, int N) {
    const int nb = K / QK, rb = nb * block_bytes(qtype);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * rb;
#if defined(__AVX512F__)
        __m512 acc[MAX_M];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512 lo, hi;
            dequant_block_v(qtype, row + (size_t)b * block_bytes(qtype), &lo, &hi);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (size_t)m * K + b * QK;
                acc[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[m]);
                acc[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[m]);
            }
        }
        for (int m = 0; m < M; m++) y[(size_t)m * N + n] = _mm512_reduce_add_ps(acc[m]);
#elif defined(__AVX2__)
        __m256 acc[MAX_M];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m256 v[4];
            dequant_block_v(qtype, row + (size_t)b * block_bytes(qtype), v);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (size_t)m * K + b * QK;
                for (int i = 0; i < 4; i++) acc[m] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + 8 * i), acc[m]);
            }
        }
        for (int m = 0; m < M; m++) y[(size_t)m * N + n] = hsum256(acc[m]);
#else
        float acc[MAX_M] = {0};
        float wv[QK];
        for (int b = 0; b < nb; b++) {
            dequant_block(qtype, row + (size_t)b * block_bytes(qtype), wv);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (size_t)m * K + b * QK;
                for (int j = 0; j < QK; j++) acc[m] += wv[j] * xb[j];
            }
        }
        for (int m = 0; m < M; m++) y[(size_t)m * N + n] = acc[m];
#endif
    }
}

/* y[M, N] = x[M, K] @ W^T, W given as N rows of K/32 blocks of `qtype`.
 * Returns 0, or -1 for an unknown type or K not a multiple of 32. */
int hp_qmatmul(int qtype, const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    if (!block_bytes(qtype) || K % QK) return -1;
    for (int m0 = 0; m0 < M; m0 += MAX_M) {
        const int mt = M - m0 < MAX_M ? M - m0 : MAX_M;
        const float *xm = x + (size_t)m0 * K;
        float *ym = y + (size_t)m0 * N;
        const int chunk = 16;  /* rows per task: small enough to balance, large enough to amortise */
        const int tasks = (N + chunk - 1) / chunk;
        #pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int t = 0; t < tasks; t++) {
            const int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            rows(qtype, xm, mt, K, w, n0, n1, ym, N);
        }
    }
    return 0;
}

/* The dequantized rows, float32 [N, K], for tests and for building float weights. */
int hp_dequantize(int qtype, const uint8_t *w, int N, int K, float *out) {
    if (!block_bytes(qtype) || K % QK) return -1;
    const int nb = K / QK;
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++)
            dequant_block(qtype, w + ((size_t)n * nb + b) * block_bytes(qtype), out + (size_t)n * K + b * QK);
    return 0;
}
