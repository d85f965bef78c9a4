/* GGUF weight blocks as stored in the file: dequantization, and the float32 products
 * of float32 mode, y[M, N] = x[M, K] @ W[N, K]^T for every M (float32 weights too, as F32).
 *
 * Each block is dequantized exactly as gguf's dequantize() does (same float32
 * operations in the same order, -ffp-contract=off), then multiplied with float32
 * activations: the result is the float32 product with the dequantized weights, up to
 * the order of the additions, while reading 4-8x fewer weight bytes than float32
 * weights. Rows of W are split over OpenMP threads.
 */
#include "hp.h"
#include "hp_api.h"

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block's 12 scale
 * bytes (gguf's Q4_K.get_scale_min). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static void dequant_q32(int qtype, const uint8_t *b, float *w) {
    const float d = load_fp16(b);
    if (qtype == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) w[j] = d * (float)q[j];
    } else if (qtype == Q4_1) {
        const float m = load_fp16(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < QK / 2; j++) { w[j] = d * (float)(q[j] & 0x0f) + m; w[j + 16] = d * (float)(q[j] >> 4) + m; }
    } else if (qtype == Q4_0) {
        const uint8_t *q = b + 2;
        for (int j = 0; j < QK / 2; j++) { w[j] = d * (float)((q[j] & 0x0f) - 8); w[j + 16] = d * (float)((q[j] >> 4) - 8); }
    } else {  /* Q5_0: d * (q - 16); Q5_1: d * q + m; the fifth bits of the 32 values in 4 bytes */
        const int has_m = qtype == Q5_1;
        const float m = has_m ? load_fp16(b + 2) : 0.0f;
        uint32_t qh; memcpy(&qh, b + 2 + 2 * has_m, 4);
        const uint8_t *q = b + 6 + 2 * has_m;
        for (int j = 0; j < QK / 2; j++) {
            const int lo = (q[j] & 0x0f) | (((qh >> j) & 1) << 4), hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            if (has_m) { w[j] = d * (float)lo + m; w[j + 16] = d * (float)hi + m; }
            else { w[j] = d * (float)(lo - 16); w[j + 16] = d * (float)(hi - 16); }
        }
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, w = (d * sc) * q - (dmin * m). */
static void dequant_q45k(int qtype, const uint8_t *b, float *w) {
    const float d = load_fp16(b), dmin = load_fp16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (qtype == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        const uint8_t *q = qs + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 0xF;
            if (qtype == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
            w[j * 32 + l] = d1 * (float)v - m1;
        }
    }
}

/* Q6_K: 16 sub-blocks of 16, w = (d * sc) * (q - 32); value h*128 + s*32 + l takes its
 * low 4 bits from ql[h*64 + (s%2)*32 + l] (nibble s/2) and its top 2 from qh[h*32 + l]
 * (bits 2s). */
static void dequant_q6k(const uint8_t *b, float *w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = load_fp16(b + 208);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                const int v = h * 128 + s * 32 + l;
                const int lo = (ql[h * 64 + (s % 2) * 32 + l] >> (4 * (s / 2))) & 0xF;
                const int hi = (qh[h * 32 + l] >> (2 * s)) & 3;
                w[v] = (d * (float)sc[v / 16]) * (float)((lo | (hi << 4)) - 32);
            }
}

/* The block_values(qtype) weights of one block, as float32, into w. */
static void dequant_block(int qtype, const uint8_t *b, float *w) {
    if (qtype == F32) memcpy(w, b, sizeof(float) * QK);
    else if (qtype == Q6_K) dequant_q6k(b, w);
    else if (qtype == Q4_K || qtype == Q5_K) dequant_q45k(qtype, b, w);
    else dequant_q32(qtype, b, w);
}

#if defined(HP_F512)
/* One Q4_0/Q4_1/Q8_0 block as two 16-float vectors. */
static inline void dequant_block_v(int qtype, const uint8_t *b, __m512 *lo, __m512 *hi) {
    const __m512 d = _mm512_set1_ps(load_fp16(b));
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
        const __m512 m = _mm512_set1_ps(load_fp16(b + 2));
        *lo = _mm512_add_ps(_mm512_mul_ps(d, l), m);
        *hi = _mm512_add_ps(_mm512_mul_ps(d, h), m);
    } else {
        const __m512 eight = _mm512_set1_ps(8.0f);
        *lo = _mm512_mul_ps(d, _mm512_sub_ps(l, eight));
        *hi = _mm512_mul_ps(d, _mm512_sub_ps(h, eight));
    }
}
#elif defined(HP_F256)
static inline __m256 cvt8(__m128i bytes8, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

/* One Q4_0/Q4_1/Q8_0 block as four 8-float vectors. */
static inline void dequant_block_v(int qtype, const uint8_t *b, __m256 *v) {
    const __m256 d = _mm256_set1_ps(load_fp16(b));
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
        const __m256 m = _mm256_set1_ps(load_fp16(b + 2));
        for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(_mm256_mul_ps(d, f[i]), m);
    } else {
        const __m256 eight = _mm256_set1_ps(8.0f);
        for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(d, _mm256_sub_ps(f[i], eight));
    }
}
#endif

/* A block's weights as float32: F32 rows as they are, the others dequantized into wv
 * (Q4_0, Q4_1, Q8_0 in vector registers; the same values as dequant_block). */
static inline const float *block_weights(int qtype, const uint8_t *b, float *wv) {
    if (qtype == F32) return (const float *)b;
#if defined(HP_F512)
    if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0) {
        __m512 lo, hi;
        dequant_block_v(qtype, b, &lo, &hi);
        _mm512_storeu_ps(wv, lo);
        _mm512_storeu_ps(wv + 16, hi);
        return wv;
    }
#elif defined(HP_F256)
    if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0) {
        __m256 v[4];
        dequant_block_v(qtype, b, v);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(wv + 8 * i, v[i]);
        return wv;
    }
#endif
    dequant_block(qtype, b, wv);
    return wv;
}

#if defined(HP_F512)
#define F32_TM 6   /* rows of x and of W a register tile takes: 24 sums in registers, x and w loads shared */
#define F32_TN 4
#else
#define F32_TM 2
#define F32_TN 2
#endif
#define F32_CHUNK 16  /* weight rows a thread's task takes, dequantized once into float32 rows */

/* Float rows wf[j] (K each, j < NB) against rows m0 .. m0 + MT - 1 of x: y[m, n0 + j] =
 * x[m] . wf[j], each a 16-lane dot product (v16): the same bits whatever M, the tile or
 * the build. One copy per tile shape (literal bounds: the sums stay in registers, no call
 * inside); tile_dot_any for the edges. */
#define TILE_DOT(NAME, MT, NB)                                                                          \
static void NAME(const float *const *wf, const float *x, int m0, int K, int n0, float *y, int N) {      \
    v16 acc[MT][NB];                                                                                    \
    for (int m = 0; m < MT; m++)                                                                        \
        for (int j = 0; j < NB; j++) acc[m][j] = v16_zero();                                            \
    const float *xr0 = x + (size_t)m0 * K;                                                              \
    for (int k = 0; k < K; k += 16) {                                                                   \
        v16 wr[NB];                                                                                     \
        for (int j = 0; j < NB; j++) wr[j] = v16_load(wf[j] + k);                                       \
        for (int m = 0; m < MT; m++) {                                                                  \
            const v16 xr = v16_load(xr0 + (size_t)m * K + k);                                           \
            for (int j = 0; j < NB; j++) acc[m][j] = v16_fmav(wr[j], xr, acc[m][j]);                    \
        }                                                                                               \
    }                                                                                                   \
    for (int m = 0; m < MT; m++)                                                                        \
        for (int j = 0; j < NB; j++) y[(size_t)(m0 + m) * N + n0 + j] = v16_hsum(acc[m][j]);            \
}
TILE_DOT(tile_dot_full, F32_TM, F32_TN)
TILE_DOT(tile_dot_row, 1, F32_TN)
TILE_DOT(tile_dot_one, 1, 1)

/* An edge tile (mt <= F32_TM rows of x, nb <= F32_TN of W), one row and one column at a time. */
static void tile_dot_any(const float *const *wf, const float *x, int m0, int mt, int K, int n0, int nb, float *y,
                         int N) {
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < nb; j++) tile_dot_one(wf + j, x, m0 + m, K, n0 + j, y, N);
}

/* Rows n0 .. n1 - 1 of W against every row of x: the weight rows as float32 (F32 rows as
 * they are, blocks dequantized once into buf, K floats a row), then register tiles. */
static void chunk_rows(int qtype, const float *x, int M, int K, const uint8_t *w, size_t rb, int n0, int n1,
                       float *y, int N, float *buf) {
    const int bv = block_values(qtype), bb = block_bytes(qtype), nblk = K / bv;
    const float *wf[F32_CHUNK];
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * rb;
        if (qtype == F32) { wf[n - n0] = (const float *)row; continue; }
        float *dst = buf + (size_t)(n - n0) * K;
        for (int b = 0; b < nblk; b++) {
            const float *src = block_weights(qtype, row + (size_t)b * bb, dst + (size_t)b * bv);
            if (src != dst + (size_t)b * bv) memcpy(dst + (size_t)b * bv, src, sizeof(float) * bv);
        }
        wf[n - n0] = dst;
    }
    for (int m0 = 0; m0 < M; m0 += F32_TM) {
        const int mt = M - m0 < F32_TM ? M - m0 : F32_TM;
        for (int n = n0; n < n1; n += F32_TN) {
            const int nb = n1 - n < F32_TN ? n1 - n : F32_TN;
            if (mt == F32_TM && nb == F32_TN) tile_dot_full(wf + (n - n0), x, m0, K, n, y, N);
            else if (mt == 1 && nb == F32_TN) tile_dot_row(wf + (n - n0), x, m0, K, n, y, N);  /* decode */
            else tile_dot_any(wf + (n - n0), x, m0, mt, K, n, nb, y, N);
        }
    }
}

/* Weight row n against rows m0 .. m0 + mt - 1 of x (mt <= F32_RM): y[m, n] = x[m] . w[n],
 * each a 16-lane dot product (v16): the same bits whatever M, the pass or the build. */
void f32_row_pass(int qtype, const float *x, int m0, int mt, int K, const uint8_t *row, int n, float *y, int N) {
    const int bv = block_values(qtype), bb = block_bytes(qtype), nb = K / bv;
    float wv[QKK];
    v16 acc[F32_RM];
    for (int m = 0; m < mt; m++) acc[m] = v16_zero();
    for (int b = 0; b < nb; b++) {
        const float *wb = block_weights(qtype, row + (size_t)b * bb, wv);
        for (int m = 0; m < mt; m++) {
            const float *xb = x + (size_t)(m0 + m) * K + (size_t)b * bv;
            for (int i = 0; i < bv; i += 16) acc[m] = v16_fma(wb + i, xb + i, acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) y[(size_t)(m0 + m) * N + n] = v16_hsum(acc[m]);
}

static int shape_ok(int qtype, int K) { return block_bytes(qtype) && K > 0 && K % block_values(qtype) == 0; }

/* y[M, N] = x[M, K] @ W^T, W given as N GGUF rows of `qtype` blocks (or F32 rows), for
 * any M: threads take chunks of 16 weight rows; within one, register tiles of F32_TM rows
 * of x and F32_TN rows of W (the group's x stays in cache while the chunk's rows pass). Every output
 * is one 16-lane dot product, so the result of a row of x does not depend on the others.
 * Returns 0; -1 for a type these kernels do not read or K not a multiple of its block; -2
 * when out of memory. */
int hp_qmatmul(int qtype, const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    if (!shape_ok(qtype, K)) return -1;
    const size_t rb = (size_t)(K / block_values(qtype)) * block_bytes(qtype);
    const int tasks = (N + F32_CHUNK - 1) / F32_CHUNK;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if (M * (size_t)N * K > 65536) reduction(|:failed)
    {
        float *buf = qtype == F32 ? NULL : malloc(sizeof(float) * F32_CHUNK * (size_t)K);
        if (qtype != F32 && !buf) failed = 1;
        #pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            const int n0 = t * F32_CHUNK, n1 = n0 + F32_CHUNK < N ? n0 + F32_CHUNK : N;
            if (!failed) chunk_rows(qtype, x, M, K, w, rb, n0, n1, y, N, buf);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* The dequantized rows, float32 [N, K] (tests, embedding lookups). Returns 0, or -1 as
 * hp_qmatmul. */
int hp_dequantize(int qtype, const uint8_t *w, int N, int K, float *out) {
    if (!shape_ok(qtype, K)) return -1;
    const int bv = block_values(qtype), bb = block_bytes(qtype), nb = K / bv;
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++)
            dequant_block(qtype, w + ((size_t)n * nb + b) * bb, out + (size_t)n * K + (size_t)b * bv);
    return 0;
}
