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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* ------------------------------------------------------------------------
 * int8 activations (what llama.cpp does for these types), on a repacked layout.
 *
 * Each row of x is quantized per 32-element block to int8 with one float scale
 * (dx = max|x| / 127, xq = round-half-even(x * 127 / max|x|)). Weight rows are
 * regrouped by 16 so that one 512-bit VNNI instruction (vpdpbusd) multiplies
 * 4 consecutive weights of 16 rows by the same 4 activations: the 16 int32 lanes
 * are 16 outputs, so no horizontal sums are needed and each weight vector serves
 * every row of x. Per block, the integer sums are scaled once:
 *     y[m, n] = sum_b  dw[n, b] * dx[m, b] * (sum_k code[n, k] * xq[m, k] - off * sum_k xq[m, k])
 *                    + mw[n, b] * dx[m, b] * sum_k xq[m, k]     (Q4_1 only; off: Q4_0 8, Q8_0 0)
 * so every path multiplies the quantized activations by the dequantized weights
 * (d * code + m): the activation rounding errors then meet centred weights. (With
 * the exact sum of x in the m term instead, they would meet d * code, which is all
 * positive: about 4x the error variance, measured as 5x the KL divergence.)
 * The integer part is exact; every path (VNNI, AVX2, plain C) does the float part in
 * the same order with fused multiply-adds, so all paths give the same bits.
 *
 * Layout of one (group of 16 rows, block) unit, the same size as 16 GGUF blocks:
 *   d as fp16 [16] | m as fp16 [16] (Q4_1 only) | codes
 *   Q4 codes: 4 chunks of 64 bytes; chunk i, byte 4j+t = code(row j, k=4i+t) | code(row j, k=4i+16+t) << 4
 *   Q8 codes: 8 chunks of 64 bytes; chunk i, byte 4j+t = q(row j, k=4i+t) (int8)
 * ------------------------------------------------------------------------ */
#define G 16

static inline int unit_bytes(int qtype) { return G * block_bytes(qtype); }
static inline int codes_offset(int qtype) { return qtype == Q4_1 ? 64 : 32; }

/* Whether the int8 path runs on vector instructions in this build (AVX-512 VNNI or AVX2;
 * else plain C). */
int hp_int8_vectorized(void) {
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* Bytes of the repacked form of an [N, K] weight (N rounded up to 16). */
long hp_repacked_bytes(int qtype, int N, int K) {
    return (long)((N + G - 1) / G) * (K / QK) * unit_bytes(qtype);
}

/* GGUF rows w [N, K/32 blocks] -> the grouped layout above (rows past N are zero). */
int hp_repack(int qtype, const uint8_t *w, int N, int K, uint8_t *out) {
    if (!block_bytes(qtype) || K % QK) return -1;
    const int nb = K / QK, bb = block_bytes(qtype), ub = unit_bytes(qtype), co = codes_offset(qtype);
    const int groups = (N + G - 1) / G;
    memset(out, 0, (size_t)hp_repacked_bytes(qtype, N, K));
    for (int g = 0; g < groups; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *u = out + ((size_t)g * nb + b) * ub, *codes = u + co;
            for (int j = 0; j < G && g * G + j < N; j++) {
                const uint8_t *src = w + ((size_t)(g * G + j) * nb + b) * bb;
                memcpy(u + 2 * j, src, 2);
                if (qtype == Q4_1) memcpy(u + 32 + 2 * j, src + 2, 2);
                for (int k = 0; k < QK; k++) {
                    const int i = (k % 16) / 4, t = k % 4;
                    if (qtype == Q8_0) {
                        codes[(k / 4) * 64 + 4 * j + t] = src[2 + k];
                    } else {
                        const uint8_t *qs = src + (qtype == Q4_1 ? 4 : 2);
                        const uint8_t c = k < 16 ? qs[k] & 0x0f : qs[k - 16] >> 4;
                        codes[i * 64 + 4 * j + t] |= (uint8_t)(k < 16 ? c : c << 4);
                    }
                }
            }
        }
    return 0;
}

/* One row of x: xq [K] int8, dx [nb], xsum [nb] = sum of xq, sx [nb] = dx * sum of xq. */
static void quantize_row(const float *x, int K, int8_t *xq, float *dx, int32_t *xsum, float *sx) {
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int k = 0; k < QK; k++) { const float a = fabsf(xb[k]); amax = a > amax ? a : amax; }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t qs = 0;
        for (int k = 0; k < QK; k++) {
            int q = (int)nearbyintf(xb[k] * id);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            xq[b * QK + k] = (int8_t)q;
            qs += q;
        }
        dx[b] = amax / 127.0f;
        xsum[b] = qs;
        sx[b] = dx[b] * (float)qs;
    }
}

static inline __attribute__((always_inline)) void code_row(int qtype, const uint8_t *codes, int j, int8_t *q) {
    for (int k = 0; k < QK; k++) {
        const int i = (k % 16) / 4, t = k % 4;
        if (qtype == Q8_0) q[k] = (int8_t)codes[(k / 4) * 64 + 4 * j + t];
        else {
            const uint8_t byte = codes[i * 64 + 4 * j + t];
            q[k] = (int8_t)(k < 16 ? byte & 0x0f : byte >> 4);
        }
    }
}

/* Plain C: one group of 16 weight rows against mt rows of quantized x (each block's
 * codes unpacked once for all rows of x). The float steps are the VNNI path's, in its order. */
static __attribute__((unused)) void group_c(int qtype, const uint8_t *gp, int nb, const int8_t *xq, const float *dx, const int32_t *xsum,
                    const float *sx, int mt, int K, float *y, int N, int nvalid) {
    const int ub = unit_bytes(qtype), off = qtype == Q4_0 ? 8 : 0;
    for (int j = 0; j < nvalid; j++) {
        for (int m = 0; m < mt; m++) y[(size_t)m * N + j] = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *u = gp + (size_t)b * ub;
            uint16_t dh; memcpy(&dh, u + 2 * j, 2);
            const float dw = fp16_to_fp32(dh);
            float mw = 0.0f;
            if (qtype == Q4_1) { uint16_t mh; memcpy(&mh, u + 32 + 2 * j, 2); mw = fp16_to_fp32(mh); }
            int8_t q[QK];
            int16_t w[QK];
            code_row(qtype, u + codes_offset(qtype), j, q);
            for (int k = 0; k < QK; k++) w[k] = qtype == Q8_0 ? q[k] : (uint8_t)q[k];
            for (int m = 0; m < mt; m++) {
                const int8_t *xb = xq + (size_t)m * K + b * QK;
                int32_t isum = -off * xsum[m * nb + b];
                for (int k = 0; k < QK; k++) isum += (int32_t)w[k] * xb[k];
                float *acc = y + (size_t)m * N + j;
                *acc = fmaf((float)isum, dw * dx[m * nb + b], *acc);
                if (qtype == Q4_1) *acc = fmaf(mw, sx[m * nb + b], *acc);
            }
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* VNNI: the 16 rows of a group are the 16 lanes; MT rows of x share each weight vector. */
static inline __attribute__((always_inline)) void group_vnni(
        const int qtype, const int MT, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
        const int32_t *xsum, const float *sx, int K, float *y, int N, int nvalid) {
    const int ub = unit_bytes(qtype), co = codes_offset(qtype);
    /* Q8_0 codes are made unsigned (q + 128) for vpdpbusd, so subtract 128 * sum(xq) */
    const int32_t off = qtype == Q4_0 ? 8 : qtype == Q8_0 ? 128 : 0;
    __m512 acc[MT];
    for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *u = gp + (size_t)b * ub;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)u));
        __m512i W[8];
        if (qtype == Q8_0) {
            const __m512i flip = _mm512_set1_epi8((char)0x80);
            for (int i = 0; i < 8; i++) W[i] = _mm512_xor_si512(_mm512_loadu_si512(u + co + 64 * i), flip);
        } else {
            const __m512i mask = _mm512_set1_epi8(0x0f);
            for (int i = 0; i < 4; i++) {
                const __m512i p = _mm512_loadu_si512(u + co + 64 * i);
                W[i] = _mm512_and_si512(p, mask);
                W[i + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
            }
        }
        for (int m = 0; m < MT; m++) {
            const int8_t *xb = xq + (size_t)m * K + b * QK;
            __m512i a = _mm512_set1_epi32(-off * xsum[m * nb + b]);
            for (int i = 0; i < 8; i++) {
                int32_t v; memcpy(&v, xb + 4 * i, 4);
                a = _mm512_dpbusd_epi32(a, W[i], _mm512_set1_epi32(v));
            }
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), acc[m]);
            if (qtype == Q4_1) {
                const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + 32)));
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
            }
        }
    }
    const __mmask16 keep = nvalid >= G ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int m = 0; m < MT; m++) _mm512_mask_storeu_ps(y + (size_t)m * N, keep, acc[m]);
}

#define VNNI_MT 8
#define VNNI_CASE(T, MT) case MT: group_vnni(T, MT, gp, nb, xq, dx, xsum, sx, K, y, N, nvalid); break;
#define VNNI_TYPE(T) static void group_vnni_##T(int mt, const uint8_t *gp, int nb, const int8_t *xq, const float *dx, \
        const int32_t *xsum, const float *sx, int K, float *y, int N, int nvalid) { \
    switch (mt) { VNNI_CASE(T, 1) VNNI_CASE(T, 2) VNNI_CASE(T, 3) VNNI_CASE(T, 4) VNNI_CASE(T, 5) \
                  VNNI_CASE(T, 6) VNNI_CASE(T, 7) VNNI_CASE(T, 8) } }
VNNI_TYPE(Q4_0)
VNNI_TYPE(Q4_1)
VNNI_TYPE(Q8_0)
#elif defined(__AVX2__)
/* AVX2 without VNNI: the 16 rows of a group as two halves of 8 int32 lanes. vpmaddubsw
 * multiplies unsigned codes by signed activations into pairs of int16; for 4-bit codes
 * (<= 15) the 8 products of a block's 32 values fit in int16 (8 * 2 * 15 * 127 < 32767),
 * so they are summed there and widened once. Q8_0's signed codes go through
 * |w| * sign(x, w) and are widened per 4 values. The loop over a block's 4-value slices
 * is outside the loop over the MT rows of x, so one slice of codes and MT partial sums
 * are live at once and 16 registers hold them without spilling (a layer's four products
 * on 1,030 rows: 37 -> 30 ms median on a 2-core Zen 3). The float steps are the VNNI path's. */
#define AVX2_MT 5  /* rows of x per call: 5 is ~6 % faster than 4, 6 or 8 on Zen 3 */
static inline __attribute__((always_inline)) void group_avx2(
        const int qtype, const int MT, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
        const int32_t *xsum, const float *sx, int K, float *y, int N, int nvalid) {
    const int ub = unit_bytes(qtype), co = codes_offset(qtype);
    const int32_t off = qtype == Q4_0 ? 8 : 0;
    const __m256i ones16 = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0f);
    for (int half = 0; half < 2; half++) {
        __m256 acc[AVX2_MT];  /* MT <= AVX2_MT: fixed sizes, not VLAs, so they live in registers */
        for (int m = 0; m < MT; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *u = gp + (size_t)b * ub, *cw = u + co + 32 * half;
            const int8_t *xb = xq + b * QK;
            __m256i s[AVX2_MT];
            for (int m = 0; m < MT; m++) s[m] = _mm256_setzero_si256();
            if (qtype == Q8_0) {
                for (int i = 0; i < 8; i++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(cw + 64 * i)), aw = _mm256_abs_epi8(w);
                    for (int m = 0; m < MT; m++) {
                        int32_t v; memcpy(&v, xb + (size_t)m * K + 4 * i, 4);
                        const __m256i pr = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(v), w));
                        s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(pr, ones16));
                        __asm__("" : "+x"(s[m]));  /* see below */
                    }
                }
            } else {
                for (int i = 0; i < 4; i++) {
                    const __m256i p = _mm256_loadu_si256((const __m256i *)(cw + 64 * i));
                    const __m256i lo = _mm256_and_si256(p, mask), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
                    for (int m = 0; m < MT; m++) {
                        int32_t vl, vh;
                        memcpy(&vl, xb + (size_t)m * K + 4 * i, 4);
                        memcpy(&vh, xb + (size_t)m * K + 16 + 4 * i, 4);
                        s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(vl)));
                        s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(vh)));
                        /* keeps each row's sum in one register, added in this order: without it gcc
                         * reassociates the integer sums, computes all products first and spills them */
                        __asm__("" : "+x"(s[m]));
                    }
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + 16 * half)));
            for (int m = 0; m < MT; m++) {
                const __m256i isum = qtype == Q8_0 ? s[m]
                    : _mm256_add_epi32(_mm256_madd_epi16(s[m], ones16), _mm256_set1_epi32(-off * xsum[m * nb + b]));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(dx[m * nb + b])), acc[m]);
                if (qtype == Q4_1) {
                    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + 32 + 16 * half)));
                    acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[m * nb + b]), acc[m]);
                }
            }
        }
        for (int m = 0; m < MT; m++) {
            if (8 * half + 8 <= nvalid) { _mm256_storeu_ps(y + (size_t)m * N + 8 * half, acc[m]); continue; }
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[m]);
            for (int j = 0; j < 8 && 8 * half + j < nvalid; j++) y[(size_t)m * N + 8 * half + j] = tmp[j];
        }
    }
}

#define AVX2_CASE(T, MT) case MT: group_avx2(T, MT, gp, nb, xq, dx, xsum, sx, K, y, N, nvalid); break;
#define AVX2_TYPE(T) static void group_avx2_##T(int mt, const uint8_t *gp, int nb, const int8_t *xq, const float *dx, \
        const int32_t *xsum, const float *sx, int K, float *y, int N, int nvalid) { \
    switch (mt) { AVX2_CASE(T, 1) AVX2_CASE(T, 2) AVX2_CASE(T, 3) AVX2_CASE(T, 4) AVX2_CASE(T, 5) } }
AVX2_TYPE(Q4_0)
AVX2_TYPE(Q4_1)
AVX2_TYPE(Q8_0)
#endif

/* This build's vector group kernel and its rows of x per call (none: plain C). */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define GROUP_MT VNNI_MT
#define GROUP(T) group_vnni_##T
#elif defined(__AVX2__)
#define GROUP_MT AVX2_MT
#define GROUP(T) group_avx2_##T
#endif

#define M_CHUNK 64  /* rows of x whose int8 form (M_CHUNK * K bytes) stays in L2 while the groups pass */

/* The body of hp_qmatmul_i8 for a thread of an enclosing parallel region (its work-sharing
 * loops end in barriers): quantizes x into xq/dx/xsum/sx (shared scratch of M * K bytes and
 * M * K / 32 entries each), then every thread takes groups of 16 weight rows. */
static void qmm_i8_team(int qtype, const float *x, int M, int K, const uint8_t *wp, int N, float *y,
                        int8_t *xq, float *dx, int32_t *xsum, float *sx) {
    const int nb = K / QK, groups = (N + G - 1) / G;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        quantize_row(x + (size_t)m * K, K, xq + (size_t)m * K, dx + (size_t)m * nb, xsum + (size_t)m * nb,
                     sx + (size_t)m * nb);
    /* (rows of x in chunks of M_CHUNK, groups): a chunk's int8 rows stay in cache while
     * the groups pass over them, instead of all of x streaming past every group */
    const int chunks = (M + M_CHUNK - 1) / M_CHUNK;
    #pragma omp for schedule(static) collapse(2)
    for (int c = 0; c < chunks; c++)
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = wp + (size_t)g * nb * unit_bytes(qtype);
        const int nvalid = N - g * G < G ? N - g * G : G;
        const int m_end = (c + 1) * M_CHUNK < M ? (c + 1) * M_CHUNK : M;
#if defined(GROUP_MT)
        for (int m0 = c * M_CHUNK; m0 < m_end; m0 += GROUP_MT) {
            const int mt = m_end - m0 < GROUP_MT ? m_end - m0 : GROUP_MT;
            const size_t xo = (size_t)m0 * nb;
            float *yo = y + (size_t)m0 * N + (size_t)g * G;
            if (qtype == Q4_0) GROUP(Q4_0)(mt, gp, nb, xq + (size_t)m0 * K, dx + xo, xsum + xo, sx + xo, K, yo, N, nvalid);
            else if (qtype == Q4_1) GROUP(Q4_1)(mt, gp, nb, xq + (size_t)m0 * K, dx + xo, xsum + xo, sx + xo, K, yo, N, nvalid);
            else GROUP(Q8_0)(mt, gp, nb, xq + (size_t)m0 * K, dx + xo, xsum + xo, sx + xo, K, yo, N, nvalid);
        }
#else
        const size_t xo = (size_t)c * M_CHUNK * nb;
        group_c(qtype, gp, nb, xq + (size_t)c * M_CHUNK * K, dx + xo, xsum + xo, sx + xo, m_end - c * M_CHUNK, K,
                y + (size_t)c * M_CHUNK * N + (size_t)g * G, N, nvalid);
#endif
    }
}

/* y[M, N] = x[M, K] @ W^T with x quantized to int8 per block; W repacked by hp_repack.
 * Returns 0; -1 for an unknown type or K not a multiple of 32; -2 when out of memory. */
int hp_qmatmul_i8(int qtype, const float *x, int M, int K, const uint8_t *wp, int N, float *y, int nthreads) {
    if (!block_bytes(qtype) || K % QK) return -1;
    const int nb = K / QK;
    int8_t *xq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * (size_t)M * nb), *sx = malloc(sizeof(float) * (size_t)M * nb);
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)M * nb);
    if (!xq || !dx || !sx || !xsum) { free(xq); free(dx); free(sx); free(xsum); return -2; }
    #pragma omp parallel num_threads(nthreads)
    qmm_i8_team(qtype, x, M, K, wp, N, y, xq, dx, xsum, sx);
    free(xq); free(dx); free(sx); free(xsum);
    return 0;
}

/* ------------------------------------------------------------------------
 * Decode attention straight from the paged KV cache (float32).
 *
 * k, v: [KVH, S, D] (head-major slots, kv_cache.py). A task attends nrows query
 * rows (D floats each, at q + rows[i] * D) to the keys of one KV head at the
 * listed slots, with an online softmax over chunks of keys: each key and value
 * is read once per task, from the pool, instead of being gathered first.
 * Writes out[rows[i]] ([D]) and lse[rows[i]] (log-sum-exp of the scaled scores,
 * for merging with attention over other keys).
 * task: [ntasks, 5] = (row offset into rows, nrows, slot offset into slots, nslots, kv head).
 * Returns 0, or -2 when out of memory.
 * ------------------------------------------------------------------------ */
#define ATT_CHUNK 32

/* This build's float vector, for attention's register tiles: VF_W lanes (none: plain C). */
#if defined(__AVX512F__)
typedef __m512 vf;
#define VF_W 16
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_fma _mm512_fmadd_ps
#elif defined(__AVX2__)
typedef __m256 vf;
#define VF_W 8
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_fma _mm256_fmadd_ps
#endif

/* exp(x) for x <= 0, in plain arithmetic so that loops over it vectorize: 2^n * e^r with
 * n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), e^r by its Taylor polynomial to
 * degree 7 (|r| <= 0.35: relative error < 1e-7, about one float ulp). Below -87 it
 * returns e^-87 (1.6e-38): a softmax weight that adds nothing next to the maximum's 1. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale2n;
    memcpy(&scale2n, &bits, 4);
    return p * scale2n;
}

/* Per-thread scratch of the attention tasks: rows of up to maxr queries of D floats. */
typedef struct { float *acc, *s, *kt, *mx, *l; } att_scratch;

static int att_scratch_alloc(att_scratch *a, int maxr, int D) {
    a->acc = malloc(sizeof(float) * (size_t)maxr * D);
    a->s = malloc(sizeof(float) * (size_t)maxr * ATT_CHUNK);
    a->kt = malloc(sizeof(float) * (size_t)D * ATT_CHUNK);  /* a chunk of keys, transposed [D, CHUNK] */
    a->mx = malloc(sizeof(float) * maxr);
    a->l = malloc(sizeof(float) * maxr);
    return a->acc && a->s && a->kt && a->mx && a->l;
}

static void att_scratch_free(att_scratch *a) { free(a->acc); free(a->s); free(a->kt); free(a->mx); free(a->l); }

/* One attention task (see hp_paged_attention): tk = (row offset, nrows, slot offset, nslots, kv head). */
static void attend_task(const float *q, const int64_t *rows, const int64_t *tk, const float *k, const float *v,
                        int64_t head_stride, int D, const int64_t *slots, float scale, float *out, float *lse,
                        const att_scratch *scr) {
    float *acc = scr->acc, *s = scr->s, *kt = scr->kt, *mx = scr->mx, *l = scr->l;
    const int64_t *rw = rows + tk[0], *sl = slots + tk[2];
    const int R = (int)tk[1], n = (int)tk[3];
    const float *kh = k + tk[4] * head_stride, *vh = v + tk[4] * head_stride;
    for (int r = 0; r < R; r++) {
        mx[r] = -INFINITY; l[r] = 0.0f;
        for (int d = 0; d < D; d++) acc[(size_t)r * D + d] = 0.0f;
    }
    for (int j0 = 0; j0 < n; j0 += ATT_CHUNK) {
        const int c = n - j0 < ATT_CHUNK ? n - j0 : ATT_CHUNK;
        int direct = 0;  /* few rows: dot products on the keys as stored, no transposition */
#if defined(__AVX512F__)
        if (R <= 4 && D % 16 == 0) {
            direct = 1;
            for (int j = 0; j < c; j++) {
                const float *kj = kh + sl[j0 + j] * D;
                for (int r = 0; r < R; r++) {
                    const float *qr = q + rw[r] * D;
                    __m512 a = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 16)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kj + d), a);
                    s[(size_t)r * ATT_CHUNK + j] = _mm512_reduce_add_ps(a);
                }
            }
        }
#endif
        if (!direct) {
            for (int j = 0; j < ATT_CHUNK; j++) {  /* keys as columns: scores need no horizontal sums */
                const float *kj = kh + sl[j0 + (j < c ? j : 0)] * D;
                for (int d = 0; d < D; d++) kt[(size_t)d * ATT_CHUNK + j] = j < c ? kj[d] : 0.0f;
            }
            for (int r = 0; r < R; r++) {
                const float *qr = q + rw[r] * D;
                float *sr = s + (size_t)r * ATT_CHUNK;
#if defined(VF_W)
                vf sv[ATT_CHUNK / VF_W];  /* the chunk's scores stay in registers over D */
                for (int u = 0; u < ATT_CHUNK / VF_W; u++) sv[u] = vf_zero();
                for (int d = 0; d < D; d++) {
                    const vf qd = vf_set1(qr[d]);
                    const float *kd = kt + (size_t)d * ATT_CHUNK;
                    for (int u = 0; u < ATT_CHUNK / VF_W; u++) sv[u] = vf_fma(qd, vf_load(kd + u * VF_W), sv[u]);
                }
                for (int u = 0; u < ATT_CHUNK / VF_W; u++) vf_store(sr + u * VF_W, sv[u]);
#else
                for (int j = 0; j < ATT_CHUNK; j++) sr[j] = 0.0f;
                for (int d = 0; d < D; d++) {
                    const float qd = qr[d];
                    const float *kd = kt + (size_t)d * ATT_CHUNK;
                    #pragma omp simd
                    for (int j = 0; j < ATT_CHUNK; j++) sr[j] = fmaf(qd, kd[j], sr[j]);
                }
#endif
            }
        }
        for (int r = 0; r < R; r++) {  /* online softmax: rescale what came before */
            float *sr = s + (size_t)r * ATT_CHUNK;
            float m = mx[r];
            for (int j = 0; j < c; j++) { sr[j] *= scale; m = sr[j] > m ? sr[j] : m; }
            const float corr = expf(mx[r] - m);  /* 0 on the first chunk (exp(-inf)) */
            float sum = 0.0f;
            #pragma omp simd reduction(+:sum)
            for (int j = 0; j < c; j++) { sr[j] = exp_nonpos(sr[j] - m); sum += sr[j]; }
            l[r] = l[r] * corr + sum;
            mx[r] = m;
            float *ar = acc + (size_t)r * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ar[d] *= corr;
        }
#if defined(VF_W)
        if (D % (4 * VF_W) == 0) {  /* 4 vectors of a row's output columns stay in registers over the chunk */
            for (int d0 = 0; d0 < D; d0 += 4 * VF_W)
                for (int r = 0; r < R; r++) {
                    float *ar = acc + (size_t)r * D + d0;
                    const float *pr = s + (size_t)r * ATT_CHUNK;
                    vf a[4];
                    for (int u = 0; u < 4; u++) a[u] = vf_load(ar + u * VF_W);
                    for (int j = 0; j < c; j++) {
                        const float *vj = vh + sl[j0 + j] * D + d0;
                        const vf p = vf_set1(pr[j]);
                        for (int u = 0; u < 4; u++) a[u] = vf_fma(p, vf_load(vj + u * VF_W), a[u]);
                    }
                    for (int u = 0; u < 4; u++) vf_store(ar + u * VF_W, a[u]);
                }
            continue;
        }
#endif
        for (int j = 0; j < c; j++) {  /* each value row once, for every query row */
            const float *vj = vh + sl[j0 + j] * D;
            for (int r = 0; r < R; r++) {
                const float p = s[(size_t)r * ATT_CHUNK + j];
                float *ar = acc + (size_t)r * D;
                #pragma omp simd
                for (int d = 0; d < D; d++) ar[d] = fmaf(p, vj[d], ar[d]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float *o = out + rw[r] * D;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) o[d] = acc[(size_t)r * D + d] * inv;
        lse[rw[r]] = mx[r] + logf(l[r]);
    }
}

static int max_task_rows(const int64_t *task, int ntasks) {
    int maxr = 1;
    for (int t = 0; t < ntasks; t++) maxr = task[5 * t + 1] > maxr ? (int)task[5 * t + 1] : maxr;
    return maxr;
}

int hp_paged_attention(const float *q, const int64_t *rows, const int64_t *task, int ntasks,
                       const float *k, const float *v, int64_t head_stride, int D, const int64_t *slots,
                       float scale, float *out, float *lse, int nthreads) {
    const int maxr = max_task_rows(task, ntasks);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        att_scratch scr;
        if (!att_scratch_alloc(&scr, maxr, D)) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < ntasks; t++) {
            if (failed) continue;
            attend_task(q, rows, task + 5 * t, k, v, head_stride, D, slots, scale, out, lse, &scr);
        }
        att_scratch_free(&scr);
    }
    return failed ? -2 : 0;
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i] for gu = [gate | up] rows of 2I floats
 * (the fused gate/up product), silu(x) = x / (1 + e^-x) with exp_nonpos: the MLP's
 * activation in one pass instead of two strided torch ops and a temporary. */
static inline void silu_mul_row(const float *g, int I, float *o) {
    const float *u = g + I;
    #pragma omp simd
    for (int i = 0; i < I; i++) {
        const float x = g[i], e = exp_nonpos(-fabsf(x)), xe = x * e;  /* e^-|x| */
        const float num = x >= 0.0f ? x : xe;  /* a select of values computed anyway: the loop vectorizes */
        o[i] = num / (1.0f + e) * u[i];
    }
}

void hp_silu_mul(const float *gu, int M, int I, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int m = 0; m < M; m++) silu_mul_row(gu + (size_t)m * 2 * I, I, out + (size_t)m * I);
}

/* Store T tokens' keys and values in a float32 pool ([KVH, S, D] per tensor) at their
 * slots: row t of k (and v) starts at k + t * k_row (v + t * v_row) and holds KVH * D
 * floats. One copy of D floats per token and head. */
static inline void kv_write_row(float *kpool, float *vpool, int64_t head_stride, int64_t slot, const float *k,
                                const float *v, int KVH, int D) {
    for (int h = 0; h < KVH; h++) {
        memcpy(kpool + h * head_stride + slot * D, k + (int64_t)h * D, sizeof(float) * D);
        memcpy(vpool + h * head_stride + slot * D, v + (int64_t)h * D, sizeof(float) * D);
    }
}

void hp_kv_write(float *kpool, float *vpool, int64_t head_stride, const int64_t *slots, int T, const float *k,
                 int64_t k_row, const float *v, int64_t v_row, int KVH, int D) {
    for (int t = 0; t < T; t++) kv_write_row(kpool, vpool, head_stride, slots[t], k + t * k_row, v + t * v_row, KVH, D);
}

/* RMSNorm of M rows of E floats (row m at x + m * x_row): out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w,
 * out contiguous [M, E]. */
static inline void rmsnorm_row(const float *xr, int E, const float *w, float eps, float *o) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int e = 0; e < E; e++) ss += xr[e] * xr[e];
    const float inv = 1.0f / sqrtf(ss / (float)E + eps);
    #pragma omp simd
    for (int e = 0; e < E; e++) o[e] = xr[e] * inv * w[e];
}

void hp_rmsnorm(const float *x, int M, int E, int64_t x_row, const float *w, float eps, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 16)
    for (int m = 0; m < M; m++) rmsnorm_row(x + m * x_row, E, w, eps, out + (size_t)m * E);
}

/* Rotary embedding in place, Llama's rotate-half form, on T rows of nh heads of D floats
 * (row t at x + t * x_row, heads contiguous): for i < D/2, with c, s = cos, sin [t, i]:
 * x[i] <- x[i] c - x[i + D/2] s and x[i + D/2] <- x[i + D/2] c + x[i] s. cos, sin: [T, D]
 * (their two halves equal, as rope() builds them). */
static inline void rope_row(float *xr, int nh, int D, const float *c, const float *s) {
    const int h2 = D / 2;
    for (int h = 0; h < nh; h++) {
        float *v = xr + (int64_t)h * D;
        #pragma omp simd
        for (int i = 0; i < h2; i++) {
            const float a = v[i], b = v[i + h2];
            v[i] = a * c[i] - b * s[i];
            v[i + h2] = b * c[i] + a * s[i];
        }
    }
}

void hp_rope(float *x, int T, int nh, int64_t x_row, int D, const float *cos_, const float *sin_, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 16)
    for (int t = 0; t < T; t++) rope_row(x + t * x_row, nh, D, cos_ + (size_t)t * D, sin_ + (size_t)t * D);
}

/* ------------------------------------------------------------------------
 * Every decoder layer of a decode step in one call and one parallel region.
 *
 * A decode step of M single-token rows (no prefill) otherwise makes ~10
 * calls per layer from Python, each with its own parallel region, plus torch's small
 * ops between them. Here the threads stay in one region for all layers and meet at the
 * work-sharing loops' barriers. Each stage is the same code as the separate calls
 * (rmsnorm_row, qmm_i8_team, rope_row, attend_task, silu_mul_row), in the same order
 * with the same additions, so the result is the same bits as the layer-by-layer path.
 * ------------------------------------------------------------------------ */

/* Row r of attention over two disjoint key sets, combined exactly (attention.py's _merge):
 * o[r] <- o_sh[r] e^(l_sh - L) + o[r] e^(l - L), L = log(e^l_sh + e^l), for D floats. */
static inline void merge_row(float *o, const float *lse, const float *osh, const float *lsh, int64_t r, int D) {
    const float a = lsh[r], b = lse[r], m = a > b ? a : b;
    const float L = m + log1pf(expf(-fabsf(a - b)));
    const float wa = expf(a - L), wb = expf(b - L);
    float *orow = o + r * D;
    const float *srow = osh + r * D;
    for (int d = 0; d < D; d++) orow[d] = srow[d] * wa + orow[d] * wb;
}

/* One layer's weights (repacked by hp_repack, with their GGUF types) and cache. */
typedef struct {
    const float *norm1, *norm2;                     /* [E] */
    const uint8_t *w_qkv, *w_o, *w_gu, *w_down;     /* [(H + 2 KVH) D, E], [E, H D], [2I, E], [E, I] */
    int t_qkv, t_o, t_gu, t_down;
    const float *b_qkv, *b_o;                       /* [(H + 2 KVH) D], [E], or NULL */
    float *kpool, *vpool;                           /* [KVH, S, D] */
} hp_layer;

/* x [M, E]: the rows' hidden states, updated in place through nlayers layers. cos, sin:
 * [M, D] (rope()'s halves); wslots [M]: where each row's key and value go; rows, task,
 * ntasks, aslots: the attention plan over each row's own context (hp_paged_attention's,
 * with rows indexing q as [M * H, D]); srows, stask, nstasks, sslots: the plan over the
 * cascades' shared prefixes (nsrows rows, each in one task; nstasks 0: none), whose
 * output is merged into those rows' by log-sum-exp (merge_row). Returns 0; -1 for a K
 * not a multiple of 32; -2 when out of memory. */
int hp_decode_layers(const hp_layer *L, int nlayers, float *x, int M, int E, int H, int KVH, int D, int I,
                     float eps, const float *cos_, const float *sin_, const int64_t *wslots, int64_t head_stride,
                     const int64_t *rows, const int64_t *task, int ntasks, const int64_t *aslots,
                     const int64_t *srows, int nsrows, const int64_t *stask, int nstasks, const int64_t *sslots,
                     float scale, int nthreads) {
    const int HD = H * D, NQKV = (H + 2 * KVH) * D;
    if (E % QK || HD % QK || I % QK) return -1;
    const int kmax = E > HD ? (E > I ? E : I) : (HD > I ? HD : I);
    const size_t nbmax = (size_t)M * (kmax / QK);
    float *h = malloc(sizeof(float) * (size_t)M * E), *qkv = malloc(sizeof(float) * (size_t)M * NQKV);
    float *qb = malloc(sizeof(float) * (size_t)M * HD), *o = malloc(sizeof(float) * (size_t)M * HD);
    float *lse = malloc(sizeof(float) * (size_t)M * H), *tmp = malloc(sizeof(float) * (size_t)M * E);
    float *osh = malloc(sizeof(float) * (size_t)M * HD), *lsh = malloc(sizeof(float) * (size_t)M * H);
    float *gu = malloc(sizeof(float) * (size_t)M * 2 * I), *act = malloc(sizeof(float) * (size_t)M * I);
    int8_t *xq = malloc((size_t)M * kmax);
    float *dx = malloc(sizeof(float) * nbmax), *sx = malloc(sizeof(float) * nbmax);
    int32_t *xsum = malloc(sizeof(int32_t) * nbmax);
    int failed = !(h && qkv && qb && o && lse && tmp && osh && lsh && gu && act && xq && dx && sx && xsum);
    const int maxr_own = max_task_rows(task, ntasks), maxr_sh = max_task_rows(stask, nstasks);
    const int maxr = maxr_own > maxr_sh ? maxr_own : maxr_sh;
    if (!failed) {
        #pragma omp parallel num_threads(nthreads) reduction(|:failed)
        {
            att_scratch scr;
            const int ok = att_scratch_alloc(&scr, maxr, D);  /* a thread without it still meets every barrier */
            if (!ok) failed = 1;
            for (int l = 0; l < nlayers; l++) {
                const hp_layer *ly = L + l;
                #pragma omp for schedule(static)
                for (int m = 0; m < M; m++) rmsnorm_row(x + (size_t)m * E, E, ly->norm1, eps, h + (size_t)m * E);
                qmm_i8_team(ly->t_qkv, h, M, E, ly->w_qkv, NQKV, qkv, xq, dx, xsum, sx);
                #pragma omp for schedule(static)
                for (int m = 0; m < M; m++) {
                    float *r = qkv + (size_t)m * NQKV;
                    if (ly->b_qkv) for (int j = 0; j < NQKV; j++) r[j] = r[j] + ly->b_qkv[j];
                    rope_row(r, H, D, cos_ + (size_t)m * D, sin_ + (size_t)m * D);
                    rope_row(r + HD, KVH, D, cos_ + (size_t)m * D, sin_ + (size_t)m * D);
                    memcpy(qb + (size_t)m * HD, r, sizeof(float) * HD);
                    kv_write_row(ly->kpool, ly->vpool, head_stride, wslots[m], r + HD, r + HD + KVH * D, KVH, D);
                }
                #pragma omp for schedule(dynamic, 1)
                for (int t = 0; t < ntasks; t++)
                    if (ok) attend_task(qb, rows, task + 5 * t, ly->kpool, ly->vpool, head_stride, D, aslots, scale,
                                        o, lse, &scr);
                if (nstasks) {  /* the same for every thread: without cascades, no extra barriers */
                    #pragma omp for schedule(dynamic, 1)
                    for (int t = 0; t < nstasks; t++)
                        if (ok) attend_task(qb, srows, stask + 5 * t, ly->kpool, ly->vpool, head_stride, D, sslots,
                                            scale, osh, lsh, &scr);
                    #pragma omp for schedule(static)
                    for (int i = 0; i < nsrows; i++) merge_row(o, lse, osh, lsh, srows[i], D);
                }
                qmm_i8_team(ly->t_o, o, M, HD, ly->w_o, E, tmp, xq, dx, xsum, sx);
                #pragma omp for schedule(static)
                for (int m = 0; m < M; m++) {
                    float *xr = x + (size_t)m * E, *tr = tmp + (size_t)m * E;
                    if (ly->b_o) for (int e = 0; e < E; e++) xr[e] = xr[e] + (tr[e] + ly->b_o[e]);
                    else for (int e = 0; e < E; e++) xr[e] = xr[e] + tr[e];
                    rmsnorm_row(xr, E, ly->norm2, eps, h + (size_t)m * E);
                }
                qmm_i8_team(ly->t_gu, h, M, E, ly->w_gu, 2 * I, gu, xq, dx, xsum, sx);
                #pragma omp for schedule(static)
                for (int m = 0; m < M; m++) silu_mul_row(gu + (size_t)m * 2 * I, I, act + (size_t)m * I);
                qmm_i8_team(ly->t_down, act, M, I, ly->w_down, E, tmp, xq, dx, xsum, sx);
                #pragma omp for schedule(static)
                for (int m = 0; m < M; m++) {
                    float *xr = x + (size_t)m * E, *tr = tmp + (size_t)m * E;
                    for (int e = 0; e < E; e++) xr[e] = xr[e] + tr[e];
                }
            }
            att_scratch_free(&scr);
        }
    }
    free(h); free(qkv); free(qb); free(o); free(lse); free(tmp); free(osh); free(lsh); free(gu); free(act);
    free(xq); free(dx); free(sx); free(xsum);
    return failed ? -2 : 0;
}
