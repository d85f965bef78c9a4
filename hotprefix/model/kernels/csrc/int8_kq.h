/* What the K-quant int8 kernels share (int8_kq.c's VNNI path, int8_amx_kq.c's AMX tiles):
 * the offsets inside repack.c's units, and (VNNI builds) a sub-block's codes unpacked to
 * bytes, 4 consecutive values of a row a 32-bit lane, and a unit's float steps. */
#ifndef HP_INT8_KQ_H
#define HP_INT8_KQ_H
#include "hp.h"

/* offsets inside a K-quant unit (repack.c's layouts) */
enum { K45_SC = 64, K45_MN = 192, K45_CODES = 320, K5_HI = 2368, K6_SC = 32, K6_LO = 288, K6_HI = 2336 };

static inline int32_t load_i32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

#if defined(HP_I512)
/* Sub-block s (32 values) of a Q4_K or Q5_K unit u: W[i] values 4i..4i+3, W[4 + i]
 * values 16 + 4i .. 16 + 4i + 3 of every row. */
static inline __attribute__((always_inline)) void kq45_codes(const int qtype, const uint8_t *u, int s, __m512i *W) {
    const __m512i mask = _mm512_set1_epi8(0x0f), m10 = _mm512_set1_epi8(0x10);
    const uint8_t *cw = u + K45_CODES + 256 * s;
    const __m512i hb = qtype == Q5_K ? _mm512_loadu_si512(u + K5_HI + 64 * s) : _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        const __m512i pc = _mm512_loadu_si512(cw + 64 * i);
        W[i] = _mm512_and_si512(pc, mask);
        W[i + 4] = _mm512_and_si512(_mm512_srli_epi16(pc, 4), mask);
        if (qtype == Q5_K) {
            W[i] = _mm512_or_si512(W[i], _mm512_and_si512(_mm512_slli_epi16(hb, 4 - i), m10));
            W[i + 4] = _mm512_or_si512(W[i + 4], _mm512_and_si512(_mm512_srli_epi16(hb, i), m10));
        }
    }
}

/* Sub-block sb (16 values) of a Q6_K unit u: v[i] values 4i..4i+3 (codes 0..63). */
static inline __attribute__((always_inline)) void kq6_codes(const uint8_t *u, int sb, __m512i *v) {
    const __m512i mask = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i p0 = _mm512_loadu_si512(u + K6_LO + 128 * sb), p1 = _mm512_loadu_si512(u + K6_LO + 128 * sb + 64);
    const __m512i h = _mm512_loadu_si512(u + K6_HI + 64 * sb);
    v[0] = _mm512_or_si512(_mm512_and_si512(p0, mask), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
    v[1] = _mm512_or_si512(_mm512_and_si512(p1, mask), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
    v[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p0, 4), mask), _mm512_and_si512(h, m30));
    v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p1, 4), mask), _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
}

/* VNNI: a unit's sums T[m] scaled into acc[m] (d_w * d_x), and for Q4_K/Q5_K the mins'
 * term through the block sums of x. */
static inline __attribute__((always_inline)) void kq_scale_vnni(
        const int qtype, const int MT, const uint8_t *u, const __m512i *T, const float *dk, const int16_t *bsb,
        int nbk, int b, __m512 *acc) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)u));
    for (int m = 0; m < MT; m++) {
        const __m512 dx = _mm512_set1_ps(dk[(size_t)m * nbk + b]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T[m]), _mm512_mul_ps(dw, dx), acc[m]);
    }
    if (qtype == Q6_K) return;
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + 32)));
    for (int m = 0; m < MT; m++) {
        __m512i M = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const __m512i mnp = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(u + K45_MN + 32 * p)));
            M = _mm512_add_epi32(M, _mm512_madd_epi16(mnp, _mm512_set1_epi32(load_i32(bsb + (size_t)m * nbk * KBS + 16 + 2 * p))));
        }
        const __m512 dx = _mm512_set1_ps(dk[(size_t)m * nbk + b]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setzero_si512(), M)),
                                 _mm512_mul_ps(dmin, dx), acc[m]);
    }
}
#endif
#endif
