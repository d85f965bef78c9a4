/* int8 group kernels of the K-quant types (Q4_K, Q5_K, Q6_K) on repack.c's layouts, with
 * x quantized per 256 values (one scale dx, int16 sums of the codes per 16 and per 32:
 * llama.cpp's Q8_K idea). The sub-block scales are integers, so a super-block's integer
 * sum takes them in exactly and one or two float steps finish it:
 *   Q4_K, Q5_K: T = sum_j sc[j] * sum_k code[k] xq[k]   (8 sub-blocks of 32)
 *               M = sum_j mn[j] * bsum32[j]
 *               y += (float)T * (d * dx);  y += (float)(-M) * (dmin * dx)
 *   Q6_K:       T = sum_j sc[j] * sum_k code[k] xq[k] - 32 * sum_j sc[j] * bsum16[j]
 *               y += (float)T * (d * dx)               (16 sub-blocks of 16, codes q + 32)
 * |T| < 2^31 for every type. Every path (VNNI, AVX2, plain C) computes the same integers
 * and does the float steps in this order with fused multiply-adds: the same bits.
 */
#include "hp.h"
#include "int8_kq.h"


/* Row j of a unit: its 256 codes, sub-block scales and (Q4_K, Q5_K) mins, from the layout. */
static void unit_row(int qtype, const uint8_t *u, int j, int *code, int *sc, int *mn) {
    if (qtype == Q6_K) {
        for (int s = 0; s < 16; s++) sc[s] = (int8_t)u[K6_SC + 32 * (s / 2) + 2 * j + s % 2];
        for (int v = 0; v < QKK; v++) {
            const int sb = v / 16, i = (v % 16) / 4, t = v % 4;
            const int lo = (u[K6_LO + 128 * sb + 64 * (i % 2) + 4 * j + t] >> (i < 2 ? 0 : 4)) & 0xF;
            code[v] = lo | (((u[K6_HI + 64 * sb + 4 * j + t] >> (2 * i)) & 3) << 4);
        }
        return;
    }
    for (int s = 0; s < 8; s++) {
        sc[s] = u[K45_SC + 32 * (s / 2) + 2 * j + s % 2];
        mn[s] = u[K45_MN + 32 * (s / 2) + 2 * j + s % 2];
        for (int l = 0; l < 32; l++) {
            const int i = (l % 16) / 4, t = l % 4;
            const uint8_t byte = u[K45_CODES + 256 * s + 64 * i + 4 * j + t];
            code[s * 32 + l] = l < 16 ? byte & 0xF : byte >> 4;
            if (qtype == Q5_K) code[s * 32 + l] |= ((u[K5_HI + 64 * s + 4 * j + t] >> (l < 16 ? i : 4 + i)) & 1) << 4;
        }
    }
}

/* Plain C: one group against mt rows of x. */
static __attribute__((unused)) void kgroup_c(int qtype, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk,
                                             const int16_t *bs, int mt, int K, float *y, int N, int nvalid) {
    const int ub = unit_bytes(qtype), sub = qtype == Q6_K ? 16 : 32, nsub = QKK / sub;
    for (int j = 0; j < nvalid; j++) {
        for (int m = 0; m < mt; m++) y[(size_t)m * N + j] = 0.0f;
        for (int b = 0; b < nbk; b++) {
            const uint8_t *u = gp + (size_t)b * ub;
            int code[QKK], sc[16], mn[8];
            unit_row(qtype, u, j, code, sc, mn);
            const float dw = load_fp16(u + 2 * j), dmin = qtype == Q6_K ? 0.0f : load_fp16(u + 32 + 2 * j);
            for (int m = 0; m < mt; m++) {
                const int8_t *xb = xq + (size_t)m * K + (size_t)b * QKK;
                const int16_t *bsm = bs + ((size_t)m * nbk + b) * KBS;
                int32_t T = 0, M = 0;
                for (int s = 0; s < nsub; s++) {
                    int32_t S = 0;
                    for (int k = 0; k < sub; k++) S += code[s * sub + k] * xb[s * sub + k];
                    T += sc[s] * S;
                    if (qtype == Q6_K) T -= 32 * sc[s] * bsm[s];
                    else M += mn[s] * bsm[16 + s];
                }
                float *acc = y + (size_t)m * N + j;
                const float dx = dk[(size_t)m * nbk + b];
                *acc = fmaf((float)T, dw * dx, *acc);
                if (qtype != Q6_K) *acc = fmaf((float)(-M), dmin * dx, *acc);
            }
        }
    }
}

/* Part i of n of the unit at `next` (ub bytes) into the cache: called n times while the
 * current unit is multiplied, so the next one arrives before it is needed (from DRAM, the
 * hardware prefetcher alone left Q6_K at ~40 % of the read bandwidth). A prefetch past
 * the group's last unit reads memory that is mapped or is simply dropped. */
static inline void prefetch_part(const uint8_t *next, int i, int n, int ub) {
    const int lines = (ub + 63) / 64, per = (lines + n - 1) / n;
    for (int l = i * per; l < (i + 1) * per && l < lines; l++) __builtin_prefetch(next + 64 * l, 0, 3);
}

#if defined(HP_I512)
#define KQ_MT 8  /* the most rows of x a call takes (the kernels' fixed-size arrays hold this many) */
/* VNNI: a Q6_K unit's integer sums per row of x into T[m] (its 16 sub-block scales applied,
 * the -32 offset of its codes taken off through the block sums of x). */
static inline __attribute__((always_inline)) void kq6_unit_vnni(
        const int MT, const uint8_t *u, int ub, const int8_t *xb, const int16_t *bsb, int nbk, int K,
        const int stream, __m512i *T) {
    for (int p = 0; p < 8; p++) {
        if (stream) prefetch_part(u + ub, p, 8, ub);
        const __m512i scp = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(u + K6_SC + 32 * p)));
        for (int m = 0; m < MT; m++) {
            const __m512i o = _mm512_madd_epi16(scp, _mm512_set1_epi32(load_i32(bsb + (size_t)m * nbk * KBS + 2 * p)));
            T[m] = _mm512_sub_epi32(T[m], _mm512_slli_epi32(o, 5));
        }
        for (int e = 0; e < 2; e++) {
            const int sb = 2 * p + e;
            const __m512i sce = e ? _mm512_srai_epi32(scp, 16) : _mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16);
            __m512i v[4];
            kq6_codes(u, sb, v);
            __m512i S[KQ_MT];  /* the rows' sums side by side (as int8_q32.c's group_vnni): MT independent chains */
            for (int m = 0; m < MT; m++) S[m] = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                for (int m = 0; m < MT; m++) {
                    const int32_t xv = load_i32(xb + (size_t)m * K + 16 * sb + 4 * i);
                    S[m] = _mm512_dpbusd_epi32(S[m], v[i], _mm512_set1_epi32(xv));
                }
            for (int m = 0; m < MT; m++) T[m] = _mm512_add_epi32(T[m], _mm512_mullo_epi32(S[m], sce));
        }
    }
}

/* VNNI: a Q4_K or Q5_K unit's integer sums per row of x into T[m] (sub-block scales applied). */
static inline __attribute__((always_inline)) void kq45_unit_vnni(
        const int qtype, const int MT, const uint8_t *u, int ub, const int8_t *xb, int K, const int stream,
        __m512i *T) {
    const __m512i lo16 = _mm512_set1_epi32(0xffff);
    for (int p = 0; p < 4; p++) {
        if (stream) prefetch_part(u + ub, p, 4, ub);
        const __m512i scp = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(u + K45_SC + 32 * p)));
        for (int e = 0; e < 2; e++) {
            const int s = 2 * p + e;
            const __m512i sce = e ? _mm512_srli_epi32(scp, 16) : _mm512_and_si512(scp, lo16);
            __m512i W[8];
            kq45_codes(qtype, u, s, W);
            __m512i S[KQ_MT];  /* the rows' sums side by side (as int8_q32.c's group_vnni): MT independent chains */
            for (int m = 0; m < MT; m++) S[m] = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                for (int h = 0; h < 2; h++)
                    for (int m = 0; m < MT; m++) {
                        const int32_t xv = load_i32(xb + (size_t)m * K + 32 * s + 16 * h + 4 * i);
                        S[m] = _mm512_dpbusd_epi32(S[m], W[i + 4 * h], _mm512_set1_epi32(xv));
                    }
            for (int m = 0; m < MT; m++) T[m] = _mm512_add_epi32(T[m], _mm512_mullo_epi32(S[m], sce));
        }
    }
}

/* VNNI: the 16 rows of a group are the 16 lanes. A sub-block's codes are unpacked once
 * for the MT rows of x; vpdpbusd sums each row's products in int32, vpmulld applies the
 * lane's scale. */
static inline __attribute__((always_inline)) void kgroup_vnni(
        const int qtype, const int MT, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk,
        const int16_t *bs, int K, float *y, int N, int nvalid, const int stream) {
    const int ub = unit_bytes(qtype);
    __m512 acc[KQ_MT];  /* MT <= KQ_MT: fixed sizes, not VLAs */
    for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < nbk; b++) {
        const uint8_t *u = gp + (size_t)b * ub;
        const int8_t *xb = xq + (size_t)b * QKK;
        const int16_t *bsb = bs + (size_t)b * KBS;
        __m512i T[KQ_MT];
        for (int m = 0; m < MT; m++) T[m] = _mm512_setzero_si512();
        if (qtype == Q6_K) kq6_unit_vnni(MT, u, ub, xb, bsb, nbk, K, stream, T);
        else kq45_unit_vnni(qtype, MT, u, ub, xb, K, stream, T);
        kq_scale_vnni(qtype, MT, u, T, dk, bsb, nbk, b, acc);
    }
    const __mmask16 keep = nvalid >= G ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int m = 0; m < MT; m++) _mm512_mask_storeu_ps(y + (size_t)m * N, keep, acc[m]);
}

#define KQ_KERNEL kgroup_vnni
#elif defined(HP_I256)
/* A lane pair (s0, s1) of int16 -> (s_e, s_e) in both halves of every 32-bit lane. */
static inline __m256i dup16(__m256i pairs, int e) {
    return e ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xF5), 0xF5)
             : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xA0), 0xA0);
}

/* AVX2: a Q6_K unit's integer sums for halves h0 .. h0 + HS - 1 of the group, per row of x,
 * into T[hh][m] (kgroup_avx2 says how the int16 sums are kept). */
static inline __attribute__((always_inline)) void kq6_unit_avx2(
        const int MT, const int HS, int h0, const uint8_t *u, int ub, const int8_t *xb, const int16_t *bsb, int nbk,
        int K, const int stream, __m256i T[2][4]) {
    const __m256i mask = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int p = 0; p < 8; p++) {
        if (stream && !h0) prefetch_part(u + ub, p, 8, ub);
        __m256i scp[2];
        for (int hh = 0; hh < HS; hh++) {
            scp[hh] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(u + K6_SC + 32 * p + 16 * (h0 + hh))));
            for (int m = 0; m < MT; m++) {
                const __m256i o = _mm256_madd_epi16(scp[hh], _mm256_set1_epi32(load_i32(bsb + (size_t)m * nbk * KBS + 2 * p)));
                T[hh][m] = _mm256_sub_epi32(T[hh][m], _mm256_slli_epi32(o, 5));
            }
        }
        for (int e = 0; e < 2; e++) {
            const int sb = 2 * p + e;
            for (int hh = 0; hh < HS; hh++) {
                const int half = h0 + hh;
                const __m256i sce = dup16(scp[hh], e);
                const uint8_t *cl = u + K6_LO + 128 * sb + 32 * half;
                const __m256i p0 = _mm256_loadu_si256((const __m256i *)cl);
                const __m256i p1 = _mm256_loadu_si256((const __m256i *)(cl + 64));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(u + K6_HI + 64 * sb + 32 * half));
                const __m256i v0 = _mm256_or_si256(_mm256_and_si256(p0, mask), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
                const __m256i v1 = _mm256_or_si256(_mm256_and_si256(p1, mask), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
                const __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p0, 4), mask), _mm256_and_si256(h, m30));
                const __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p1, 4), mask),
                                                   _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
                for (int m = 0; m < MT; m++) {
                    const int8_t *xs = xb + (size_t)m * K + 16 * sb;
                    __m256i s1 = _mm256_maddubs_epi16(v0, _mm256_set1_epi32(load_i32(xs)));
                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(v1, _mm256_set1_epi32(load_i32(xs + 4))));
                    __m256i s2 = _mm256_maddubs_epi16(v2, _mm256_set1_epi32(load_i32(xs + 8)));
                    s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(v3, _mm256_set1_epi32(load_i32(xs + 12))));
                    T[hh][m] = _mm256_add_epi32(T[hh][m], _mm256_add_epi32(_mm256_madd_epi16(s1, sce),
                                                                           _mm256_madd_epi16(s2, sce)));
                    __asm__("" : "+x"(T[hh][m]));
                }
            }
        }
    }
}

/* AVX2: a Q4_K or Q5_K sub-block s of half `half`, per row of x, added into T[m]. */
static inline __attribute__((always_inline)) void kq45_sub_avx2(
        const int qtype, const int MT, const uint8_t *u, int s, int half, __m256i sce, const int8_t *xb, int K,
        __m256i *T) {
    const __m256i mask = _mm256_set1_epi8(0x0f), m10 = _mm256_set1_epi8(0x10);
    const uint8_t *cw = u + K45_CODES + 256 * s + 32 * half;
    const __m256i hb = qtype == Q5_K ? _mm256_loadu_si256((const __m256i *)(u + K5_HI + 64 * s + 32 * half))
                                     : _mm256_setzero_si256();
    __m256i acc16[4];
    for (int m = 0; m < MT; m++) acc16[m] = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256i pc = _mm256_loadu_si256((const __m256i *)(cw + 64 * i));
        __m256i lo = _mm256_and_si256(pc, mask), hi = _mm256_and_si256(_mm256_srli_epi16(pc, 4), mask);
        if (qtype == Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4 - i), m10));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(hb, i), m10));
        }
        for (int m = 0; m < MT; m++) {
            const int8_t *xs = xb + (size_t)m * K + 32 * s;
            acc16[m] = _mm256_add_epi16(acc16[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xs + 4 * i))));
            acc16[m] = _mm256_add_epi16(acc16[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xs + 16 + 4 * i))));
            __asm__("" : "+x"(acc16[m]));
            if (qtype == Q5_K && i == 1) {  /* 5-bit codes: widen after 4 products of 2 */
                T[m] = _mm256_add_epi32(T[m], _mm256_madd_epi16(acc16[m], sce));
                acc16[m] = _mm256_setzero_si256();
            }
        }
    }
    for (int m = 0; m < MT; m++) T[m] = _mm256_add_epi32(T[m], _mm256_madd_epi16(acc16[m], sce));
}

/* AVX2: a Q4_K or Q5_K unit's integer sums for halves h0 .. h0 + HS - 1, per row of x, into T[hh][m]. */
static inline __attribute__((always_inline)) void kq45_unit_avx2(
        const int qtype, const int MT, const int HS, int h0, const uint8_t *u, int ub, const int8_t *xb, int K,
        const int stream, __m256i T[2][4]) {
    for (int p = 0; p < 4; p++) {
        if (stream && !h0) prefetch_part(u + ub, p, 4, ub);
        __m256i scp[2];
        for (int hh = 0; hh < HS; hh++)
            scp[hh] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(u + K45_SC + 32 * p + 16 * (h0 + hh))));
        for (int e = 0; e < 2; e++)
            for (int hh = 0; hh < HS; hh++)
                kq45_sub_avx2(qtype, MT, u, 2 * p + e, h0 + hh, dup16(scp[hh], e), xb, K, T[hh]);
    }
}

/* AVX2: half `half`'s sums T[m] scaled into acc[m] (d_w * d_x), and for Q4_K/Q5_K the
 * mins' term through the block sums of x. */
static inline __attribute__((always_inline)) void kq_scale_avx2(
        const int qtype, const int MT, const uint8_t *u, int half, const __m256i *T, const float *dk,
        const int16_t *bsb, int nbk, int b, __m256 *acc) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + 16 * half)));
    for (int m = 0; m < MT; m++) {
        const __m256 dx = _mm256_set1_ps(dk[(size_t)m * nbk + b]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T[m]), _mm256_mul_ps(dw, dx), acc[m]);
    }
    if (qtype == Q6_K) return;
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + 32 + 16 * half)));
    for (int m = 0; m < MT; m++) {
        __m256i M = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i mnp = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(u + K45_MN + 32 * p + 16 * half)));
            M = _mm256_add_epi32(M, _mm256_madd_epi16(mnp, _mm256_set1_epi32(load_i32(bsb + (size_t)m * nbk * KBS + 16 + 2 * p))));
        }
        const __m256 dx = _mm256_set1_ps(dk[(size_t)m * nbk + b]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setzero_si256(), M)),
                                 _mm256_mul_ps(dmin, dx), acc[m]);
    }
}

/* AVX2: the 16 rows of a group as two halves of 8 int32 lanes. vpmaddubsw gives pairs
 * of int16 products; they are summed in int16 while they fit (4-bit codes: 8 products
 * of 2, 5-bit: 4, 6-bit: 2; 127 * 2 * code max each) and widened by vpmaddwd against
 * the lane's scale pair (s, s), which applies the sub-block scale at no extra cost. As
 * in the 32-value kernel, slices of codes are outside the loop over the rows of x and
 * each row's int16 sum is pinned to a register. With one row of x (decode) both halves
 * go in one pass, so that each 64-byte line of the units is read once while the next
 * unit streams in (two passes left memory idle through the second: 20 -> 23 GB/s);
 * with more, one half a pass for the registers. Either way every output lane sees the
 * same operations in the same order. */
static inline __attribute__((always_inline)) void kgroup_avx2(
        const int qtype, const int MT, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk,
        const int16_t *bs, int K, float *y, int N, int nvalid, const int stream) {
    const int HS = MT == 1 ? 2 : 1;  /* halves a pass */
    const int ub = unit_bytes(qtype);
    for (int h0 = 0; h0 < 2; h0 += HS) {
        __m256 acc[2][4];
        for (int hh = 0; hh < HS; hh++)
            for (int m = 0; m < MT; m++) acc[hh][m] = _mm256_setzero_ps();
        for (int b = 0; b < nbk; b++) {
            const uint8_t *u = gp + (size_t)b * ub;
            const int8_t *xb = xq + (size_t)b * QKK;
            const int16_t *bsb = bs + (size_t)b * KBS;
            __m256i T[2][4];
            for (int hh = 0; hh < HS; hh++)
                for (int m = 0; m < MT; m++) T[hh][m] = _mm256_setzero_si256();
            if (qtype == Q6_K) kq6_unit_avx2(MT, HS, h0, u, ub, xb, bsb, nbk, K, stream, T);
            else kq45_unit_avx2(qtype, MT, HS, h0, u, ub, xb, K, stream, T);
            for (int hh = 0; hh < HS; hh++) kq_scale_avx2(qtype, MT, u, h0 + hh, T[hh], dk, bsb, nbk, b, acc[hh]);
        }
        for (int hh = 0; hh < HS; hh++)
            for (int m = 0; m < MT; m++) store_half(y + (size_t)m * N, h0 + hh, nvalid, acc[hh][m]);
    }
}

#define KQ_MT 4
#define KQ_KERNEL kgroup_avx2
#endif

#if defined(KQ_KERNEL)
/* (stream a compile-time constant in each copy: the prefetches cost nothing where they are off) */
#define KQ_CASE(T, MT) case MT: { if (stream) KQ_KERNEL(T, MT, gp, nbk, xq, dk, bs, K, y, N, nvalid, 1); \
                                  else KQ_KERNEL(T, MT, gp, nbk, xq, dk, bs, K, y, N, nvalid, 0); } break;
#if KQ_MT > 4
#define KQ_ROWS_5_8(T) KQ_CASE(T, 5) KQ_CASE(T, 6) KQ_CASE(T, 7) KQ_CASE(T, 8)
#else
#define KQ_ROWS_5_8(T)
#endif
#define KQ_TYPE(T) static void kgroup_##T(int mt, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk, \
        const int16_t *bs, int K, float *y, int N, int nvalid, int stream) { \
    switch (mt) { KQ_CASE(T, 1) KQ_CASE(T, 2) KQ_CASE(T, 3) KQ_CASE(T, 4) KQ_ROWS_5_8(T) } }
KQ_TYPE(Q4_K)
KQ_TYPE(Q5_K)
KQ_TYPE(Q6_K)

int group_kq_rows(void) { return KQ_MT; }

void group_kq(int qtype, int mt, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk,
              const int16_t *bs, int K, float *y, int ldy, int nvalid, int stream) {
    if (qtype == Q4_K) kgroup_Q4_K(mt, gp, nbk, xq, dk, bs, K, y, ldy, nvalid, stream);
    else if (qtype == Q5_K) kgroup_Q5_K(mt, gp, nbk, xq, dk, bs, K, y, ldy, nvalid, stream);
    else kgroup_Q6_K(mt, gp, nbk, xq, dk, bs, K, y, ldy, nvalid, stream);
}
#else
int group_kq_rows(void) { return 1 << 20; }

void group_kq(int qtype, int mt, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk,
              const int16_t *bs, int K, float *y, int ldy, int nvalid, int stream) {
    (void)stream;
    kgroup_c(qtype, gp, nbk, xq, dk, bs, mt, K, y, ldy, nvalid);
}
#endif
