/* int8 group kernels of the 32-value block types (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1), on
 * repack.c's layouts, with x quantized per 32 values (int8.c):
 *     y[m, n] = sum_b  dw[n, b] * dx[m, b] * (sum_k code[n, k] * xq[m, k] - off * sum_k xq[m, k])
 *                    + mw[n, b] * dx[m, b] * sum_k xq[m, k]     (Q4_1, Q5_1; off: Q4_0 8, else 0)
 * so every path multiplies the quantized activations by the dequantized weights
 * (d * code + m): the activation rounding errors then meet centred weights. (With the
 * exact sum of x in the m term instead, they would meet d * code, which is all positive:
 * about 4x the error variance, measured as 5x the KL divergence.)
 * The integer part is exact; every path (VNNI, AVX2, plain C) does the float part in the
 * same order with fused multiply-adds, so all paths give the same bits.
 */
#include "hp.h"

static inline int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }
static inline int codes_offset(int qtype) { return has_min(qtype) ? 64 : 32; }
static inline int byte_codes(int qtype) { return qtype == Q8_0 || qtype == Q5_0 || qtype == Q5_1; }
static inline int signed_codes(int qtype) { return qtype == Q8_0 || qtype == Q5_0; }

/* Row j's 32 codes of a unit's code area (as the multiplier uses them). */
static inline __attribute__((always_inline)) void code_row(int qtype, const uint8_t *codes, int j, int16_t *w) {
    for (int k = 0; k < QK; k++) {
        if (byte_codes(qtype)) {
            const uint8_t c = codes[(k / 4) * 64 + 4 * j + k % 4];
            w[k] = signed_codes(qtype) ? (int8_t)c : c;
        } else {
            const uint8_t byte = codes[((k % 16) / 4) * 64 + 4 * j + k % 4];
            w[k] = k < 16 ? byte & 0x0f : byte >> 4;
        }
    }
}

/* Plain C: one group of 16 weight rows against mt rows of quantized x (each block's
 * codes unpacked once for all rows of x). The float steps are the VNNI path's, in its order. */
static __attribute__((unused)) void group_c(int qtype, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
                                            const int32_t *xsum, const float *sx, int mt, int K, float *y, int N,
                                            int nvalid) {
    const int ub = unit_bytes(qtype), off = qtype == Q4_0 ? 8 : 0;
    for (int j = 0; j < nvalid; j++) {
        for (int m = 0; m < mt; m++) y[(size_t)m * N + j] = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *u = gp + (size_t)b * ub;
            const float dw = load_fp16(u + 2 * j), mw = has_min(qtype) ? load_fp16(u + 32 + 2 * j) : 0.0f;
            int16_t w[QK];
            code_row(qtype, u + codes_offset(qtype), j, w);
            for (int m = 0; m < mt; m++) {
                const int8_t *xb = xq + (size_t)m * K + b * QK;
                int32_t isum = -off * xsum[m * nb + b];
                for (int k = 0; k < QK; k++) isum += (int32_t)w[k] * xb[k];
                float *acc = y + (size_t)m * N + j;
                *acc = fmaf((float)isum, dw * dx[m * nb + b], *acc);
                if (has_min(qtype)) *acc = fmaf(mw, sx[m * nb + b], *acc);
            }
        }
    }
}

#if defined(HP_I512)
#define Q32_MT 8  /* the most rows of x a call takes (the kernels' fixed-size arrays hold this many) */
/* VNNI: the 16 rows of a group are the 16 lanes; MT rows of x share each weight vector. */
static inline __attribute__((always_inline)) void group_vnni(
        const int qtype, const int MT, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
        const int32_t *xsum, const float *sx, int K, float *y, int N, int nvalid) {
    const int ub = unit_bytes(qtype), co = codes_offset(qtype);
    /* signed 8-bit codes are made unsigned (q + 128) for vpdpbusd, so subtract 128 * sum(xq) */
    const int32_t off = qtype == Q4_0 ? 8 : signed_codes(qtype) ? 128 : 0;
    __m512 acc[Q32_MT];  /* MT <= Q32_MT: fixed sizes, not VLAs, so they live in registers, not on the stack */
    for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *u = gp + (size_t)b * ub;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)u));
        __m512i W[8];
        if (byte_codes(qtype)) {
            const __m512i flip = _mm512_set1_epi8(signed_codes(qtype) ? (char)0x80 : 0);
            for (int i = 0; i < 8; i++) W[i] = _mm512_xor_si512(_mm512_loadu_si512(u + co + 64 * i), flip);
        } else {
            nibble_codes(u + co, W);
        }
        /* the rows' integer sums side by side, a 4-value slice of every row in turn: MT independent
         * vpdpbusd chains (one row's 8 in a row wait on each other's latency); exact, so any order */
        __m512i a[Q32_MT];
        for (int m = 0; m < MT; m++) a[m] = _mm512_set1_epi32(-off * xsum[m * nb + b]);
        for (int i = 0; i < 8; i++)
            for (int m = 0; m < MT; m++) {
                int32_t v; memcpy(&v, xq + (size_t)m * K + b * QK + 4 * i, 4);
                a[m] = _mm512_dpbusd_epi32(a[m], W[i], _mm512_set1_epi32(v));
            }
        for (int m = 0; m < MT; m++) {
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b])), acc[m]);
            if (has_min(qtype)) {
                const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + 32)));
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
            }
        }
    }
    const __mmask16 keep = nvalid >= G ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int m = 0; m < MT; m++) _mm512_mask_storeu_ps(y + (size_t)m * N, keep, acc[m]);
}

#define Q32_KERNEL group_vnni
#elif defined(HP_I256)
/* AVX2 without VNNI: the 16 rows of a group as two halves of 8 int32 lanes. vpmaddubsw
 * multiplies unsigned codes by signed activations into pairs of int16; for 4-bit codes
 * (<= 15) the 8 products of a block's 32 values fit in int16 (8 * 2 * 15 * 127 < 32767),
 * so they are summed there and widened once. 8-bit codes are widened per 4 values,
 * signed ones through |w| * sign(x, w). The loop over a block's 4-value slices is outside
 * the loop over the MT rows of x, so one slice of codes and MT partial sums are live at
 * once and 16 registers hold them without spilling (a layer's four products on 1,030
 * rows: 37 -> 30 ms median on a 2-core Zen 3). The float steps are the VNNI path's. */
/* long: one register-blocked loop nest; split, its live registers would spill */
static inline __attribute__((always_inline)) void group_avx2(
        const int qtype, const int MT, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
        const int32_t *xsum, const float *sx, int K, float *y, int N, int nvalid) {
    const int HS = MT == 1 ? 2 : 1;  /* halves a pass: both for one row of x (each line read once), as int8_kq.c */
    const int ub = unit_bytes(qtype), co = codes_offset(qtype);
    const int32_t off = qtype == Q4_0 ? 8 : 0;
    const __m256i ones16 = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0f);
    for (int h0 = 0; h0 < 2; h0 += HS) {
        __m256 acc[2][5];  /* MT <= 5: fixed sizes, not VLAs, so they live in registers */
        for (int hh = 0; hh < HS; hh++)
            for (int m = 0; m < MT; m++) acc[hh][m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *u = gp + (size_t)b * ub;
            const int8_t *xb = xq + b * QK;
            __m256i s[2][5];
            for (int hh = 0; hh < HS; hh++)
                for (int m = 0; m < MT; m++) s[hh][m] = _mm256_setzero_si256();
            for (int hh = 0; hh < HS; hh++) {
                const uint8_t *cw = u + co + 32 * (h0 + hh);
                if (byte_codes(qtype)) {
                    for (int i = 0; i < 8; i++) {
                        const __m256i w = _mm256_loadu_si256((const __m256i *)(cw + 64 * i));
                        const __m256i aw = signed_codes(qtype) ? _mm256_abs_epi8(w) : w;
                        for (int m = 0; m < MT; m++) {
                            int32_t v; memcpy(&v, xb + (size_t)m * K + 4 * i, 4);
                            const __m256i xv = _mm256_set1_epi32(v);
                            const __m256i pr = _mm256_maddubs_epi16(aw, signed_codes(qtype) ? _mm256_sign_epi8(xv, w) : xv);
                            s[hh][m] = _mm256_add_epi32(s[hh][m], _mm256_madd_epi16(pr, ones16));
                            __asm__("" : "+x"(s[hh][m]));  /* see below */
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
                            s[hh][m] = _mm256_add_epi16(s[hh][m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(vl)));
                            s[hh][m] = _mm256_add_epi16(s[hh][m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(vh)));
                            /* keeps each row's sum in one register, added in this order: without it gcc
                             * reassociates the integer sums, computes all products first and spills them */
                            __asm__("" : "+x"(s[hh][m]));
                        }
                    }
                }
            }
            for (int hh = 0; hh < HS; hh++) {
                const int half = h0 + hh;
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + 16 * half)));
                for (int m = 0; m < MT; m++) {
                    const __m256i isum = byte_codes(qtype) ? s[hh][m]
                        : _mm256_add_epi32(_mm256_madd_epi16(s[hh][m], ones16), _mm256_set1_epi32(-off * xsum[m * nb + b]));
                    acc[hh][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(dx[m * nb + b])),
                                                 acc[hh][m]);
                    if (has_min(qtype)) {
                        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + 32 + 16 * half)));
                        acc[hh][m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[m * nb + b]), acc[hh][m]);
                    }
                }
            }
        }
        for (int hh = 0; hh < HS; hh++)
            for (int m = 0; m < MT; m++) store_half(y + (size_t)m * N, h0 + hh, nvalid, acc[hh][m]);
    }
}

#define Q32_MT 5  /* rows of x per call: 5 is ~6 % faster than 4, 6 or 8 on Zen 3 */
#define Q32_KERNEL group_avx2
#endif

#if defined(Q32_KERNEL)
/* One specialised copy per (type, rows of x): the type's branches and the row loops
 * resolve at compile time. */
#define Q32_CASE(T, MT) case MT: Q32_KERNEL(T, MT, gp, nb, xq, dx, xsum, sx, K, y, N, nvalid); break;
#define Q32_TYPE(T) static void group_##T(int mt, const uint8_t *gp, int nb, const int8_t *xq, const float *dx, \
        const int32_t *xsum, const float *sx, int K, float *y, int N, int nvalid) { \
    switch (mt) { Q32_CASE(T, 1) Q32_CASE(T, 2) Q32_CASE(T, 3) Q32_CASE(T, 4) Q32_CASE(T, 5) \
                  Q32_ROWS_6_8(T) } }
#if Q32_MT > 5
#define Q32_ROWS_6_8(T) Q32_CASE(T, 6) Q32_CASE(T, 7) Q32_CASE(T, 8)
#else
#define Q32_ROWS_6_8(T)
#endif
Q32_TYPE(Q4_0)
Q32_TYPE(Q4_1)
Q32_TYPE(Q8_0)
Q32_TYPE(Q5_1)

int group_q32_rows(void) { return Q32_MT; }

void group_q32(int qtype, int mt, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
               const int32_t *xsum, const float *sx, int K, float *y, int ldy, int nvalid) {
    switch (qtype) {
        case Q4_0: group_Q4_0(mt, gp, nb, xq, dx, xsum, sx, K, y, ldy, nvalid); break;
        case Q4_1: group_Q4_1(mt, gp, nb, xq, dx, xsum, sx, K, y, ldy, nvalid); break;
        case Q5_1: group_Q5_1(mt, gp, nb, xq, dx, xsum, sx, K, y, ldy, nvalid); break;
        default: group_Q8_0(mt, gp, nb, xq, dx, xsum, sx, K, y, ldy, nvalid); break;  /* Q8_0, Q5_0 */
    }
}
#else
int group_q32_rows(void) { return 1 << 20; }  /* plain C takes every row of a chunk at once */

void group_q32(int qtype, int mt, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
               const int32_t *xsum, const float *sx, int K, float *y, int ldy, int nvalid) {
    group_c(qtype, gp, nb, xq, dx, xsum, sx, mt, K, y, ldy, nvalid);
}
#endif
