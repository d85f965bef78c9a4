/* AMX tiles for the K-quant int8 products (int8_amx.c says how the tiles are used).
 *
 * A super-block's integer sum for weight row n and row of x is T = sum_s sc_s sum_{k in s}
 * x_k code_k (int8_kq.c). The sub-block scales sc_s (integers) are split into digits,
 * sc = sum_i d_i BASE^i, each small enough that code * d_i fits in a signed byte:
 *   Q4_K  codes 0..15, sc 0..63:              2 digits of base 8  (code d <= 105)
 *   Q5_K  codes 0..31, sc 0..63:              3 digits of base 4  (<= 93)
 *   Q6_K  codes - 32 in -32..31, sc -128..127: 4 digits of base 4, the top one signed
 *         (-2..1), which also folds in the codes' -32 offset (<= 96 in magnitude)
 * so B_i = code * d_i carries the scales and one tdpbssd chain over the whole super-block
 * (4 products of 64 values a digit) gives C_i = sum_k x_k code_k d_i(k); then
 * T = sum_i C_i BASE^i exactly, and the unit's float steps (kq_scale_vnni) follow in
 * int8_kq.c's order: its bits. The digits' B tiles are made once a unit and serve every
 * tile of x of the run.
 */
#include "hp.h"
#include "int8_kq.h"

#if defined(HP_AMX)
#define KQ_RUN 4  /* tiles of x a run: their float sums (4 KB each) stay in L1 across units */

static inline int digits(int qtype) { return qtype == Q4_K ? 2 : qtype == Q5_K ? 3 : 4; }
static inline int digit_bits(int qtype) { return qtype == Q4_K ? 3 : 2; }

/* The bytes of W (signed) times their 32-bit lane's digit d (d in both 16-bit halves). */
static inline __m512i times_digit(__m512i W, __m512i d16) {
    const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(W, 8), 8), odd = _mm512_srai_epi16(W, 8);
    const __m512i pe = _mm512_mullo_epi16(even, d16), po = _mm512_mullo_epi16(odd, d16);
    return _mm512_or_si512(_mm512_and_si512(pe, _mm512_set1_epi16(0x00ff)), _mm512_slli_epi16(po, 8));
}

/* Sub-block s's codes (W, nv vectors: Q6_K's - 32) and scales as int32 lanes (sce). */
static inline __attribute__((always_inline)) void kq_sub(const int qtype, const uint8_t *u, int s, __m512i *W,
                                                         __m512i *sce) {
    const int p = s / 2, e = s % 2;
    if (qtype == Q6_K) {
        kq6_codes(u, s, W);
        for (int i = 0; i < 4; i++) W[i] = _mm512_sub_epi8(W[i], _mm512_set1_epi8(32));
        const __m512i scp = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(u + K6_SC + 32 * p)));
        *sce = e ? _mm512_srai_epi32(scp, 16) : _mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16);
    } else {
        kq45_codes(qtype, u, s, W);
        const __m512i scp = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(u + K45_SC + 32 * p)));
        *sce = e ? _mm512_srli_epi32(scp, 16) : _mm512_and_si512(scp, _mm512_set1_epi32(0xffff));
    }
}

/* Unit u's B tiles: digit i's at bt + 4096 i, the products of 64 values (2 sub-blocks of
 * 32 or 4 of 16) 1024 bytes each, 16 rows of 64. */
static inline __attribute__((always_inline)) void kq_unit(const int qtype, const uint8_t *u, uint8_t *bt) {
    const int ns = qtype == Q6_K ? 16 : 8, nv = qtype == Q6_K ? 4 : 8, nd = digits(qtype), db = digit_bits(qtype);
    const __m512i dmask = _mm512_set1_epi32((1 << db) - 1), lo16 = _mm512_set1_epi32(0xffff);
    for (int s = 0; s < ns; s++) {
        __m512i W[8], sce;
        kq_sub(qtype, u, s, W, &sce);
        for (int i = 0; i < nd; i++) {
            __m512i d = _mm512_srai_epi32(sce, db * i);  /* the top digit keeps the sign */
            if (i < nd - 1) d = _mm512_and_si512(d, dmask);
            const __m512i d16 = _mm512_or_si512(_mm512_and_si512(d, lo16), _mm512_slli_epi32(d, 16));
            for (int v = 0; v < nv; v++) _mm512_store_si512(bt + 4096 * i + 64 * (nv * s + v), times_digit(W[v], d16));
        }
    }
}

/* Unit b's digits (kq_unit's bt) against one tile of 16 rows of x (xq at its first row),
 * or two (two: rows 16 .. 31 too, Q4_K's 2 digits only), every digit's int32 sums into c
 * (c[i]: digit i of the first tile; c[2 + i]: of the second). Tiles 0-3: C; 4, 5: A;
 * 6, 7: B (one tile: 5 too, and digit 3's B reuses 6). */
static inline __attribute__((always_inline)) void kq_dots(const int qtype, int b, const uint8_t *bt,
                                                          const int8_t *xq, int K, const int two,
                                                          int32_t (*c)[256]) {
    const int nd = digits(qtype);
    _tile_zero(0); _tile_zero(1);
    if (nd > 2 || two) _tile_zero(2);
    if (nd > 3 || two) _tile_zero(3);
    for (int j = 0; j < 4; j++) {
        const uint8_t *bj = bt + 1024 * j, *xj = (const uint8_t *)xq + (size_t)b * QKK + 64 * j;
        _tile_loadd(4, xj, K);
        _tile_loadd(6, bj, 64); _tile_loadd(7, bj + 4096, 64);
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7);
        if (two) {
            _tile_loadd(5, xj + (size_t)16 * K, K);
            _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
        }
        if (nd > 2) { _tile_loadd(5, bj + 8192, 64); _tile_dpbssd(2, 4, 5); }
        if (nd > 3) { _tile_loadd(6, bj + 12288, 64); _tile_dpbssd(3, 4, 6); }
    }
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
    if (nd > 2 || two) _tile_stored(2, c[2], 64);
    if (nd > 3 || two) _tile_stored(3, c[3], 64);
}

/* A tile's T = sum_i c[i] BASE^i, then unit b's float steps into acc (16 rows of 16; dk,
 * bs at the tile's first row). */
static inline __attribute__((always_inline)) void kq_finish(const int qtype, const uint8_t *u, int b, int nbk,
                                                            int32_t (*c)[256], const float *dk, const int16_t *bs,
                                                            float *acc) {
    const int nd = digits(qtype), db = digit_bits(qtype);
    __m512i T[16];
    __m512 a[16];
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        T[r] = _mm512_load_si512(c[0] + 16 * r);
        for (int i = 1; i < nd; i++) T[r] = _mm512_add_epi32(T[r], _mm512_slli_epi32(_mm512_load_si512(c[i] + 16 * r), db * i));
        a[r] = b ? _mm512_load_ps(acc + 16 * r) : _mm512_setzero_ps();  /* (unit 0: no sums yet) */
    }
    kq_scale_vnni(qtype, 16, u, T, dk, bs + (size_t)b * KBS, nbk, b, a);
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) _mm512_store_ps(acc + 16 * r, a[r]);
}

/* A group (gp: its nbk units) against nt tiles of x from xk's row 0 (pointers offset); y's first mr rows. */
static inline __attribute__((always_inline)) void amx_kq_group(
        const int qtype, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk, const int16_t *bs, int K,
        int nt, int mr, float *y, int ldy, int nvalid) {
    const int ub = unit_bytes(qtype), pair = digits(qtype) == 2;  /* two tiles of x a unit's B tiles */
    uint8_t bt[4 * 4096] __attribute__((aligned(64)));
    int32_t c[4][256] __attribute__((aligned(64)));
    float acc[KQ_RUN][256] __attribute__((aligned(64)));
    for (int t0 = 0; t0 < nt; t0 += KQ_RUN) {
        const int tn = nt - t0 < KQ_RUN ? nt - t0 : KQ_RUN;
        for (int b = 0; b < nbk; b++) {
            const uint8_t *u = gp + (size_t)b * ub;
            kq_unit(qtype, u, bt);
            for (int t = 0; t < tn; t += 1 + pair) {
                const size_t m = (size_t)16 * (t0 + t);
                const int two = pair && t + 1 < tn;
                if (two) kq_dots(qtype, b, bt, xq + m * K, K, 1, c);
                else kq_dots(qtype, b, bt, xq + m * K, K, 0, c);
                kq_finish(qtype, u, b, nbk, c, dk + m * nbk, bs + m * nbk * KBS, acc[t]);
                if (two) kq_finish(qtype, u, b, nbk, c + 2, dk + (m + 16) * nbk, bs + (m + 16) * nbk * KBS, acc[t + 1]);
            }
        }
        amx_store(acc[0], tn, mr - 16 * t0, y + (size_t)16 * t0 * ldy, ldy, nvalid);
    }
}

#define AMX_KQ(T) static void amx_##T(const uint8_t *gp, int nbk, const int8_t *xq, const float *dk, \
        const int16_t *bs, int K, int nt, int mr, float *y, int ldy, int nvalid) { \
    amx_kq_group(T, gp, nbk, xq, dk, bs, K, nt, mr, y, ldy, nvalid); }
AMX_KQ(Q4_K)
AMX_KQ(Q5_K)
AMX_KQ(Q6_K)

int amx_kq(const hp_part *pt, int g, int K, int m0, int nt, int mr, const xquant *xk, float *y, int ldy, int nvalid) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    const int qt = pt->qtype, nbk = K / QKK;
    const uint8_t *gp = pt->w + (size_t)g * nbk * unit_bytes(qt);
    const int8_t *xq = xk->q + (size_t)m0 * K;
    const float *dk = xk->d + (size_t)m0 * nbk;
    const int16_t *bs = xk->bs + (size_t)m0 * nbk * KBS;
    amx_load_config(rows, colsb);
    if (qt == Q4_K) amx_Q4_K(gp, nbk, xq, dk, bs, K, nt, mr, y, ldy, nvalid);
    else if (qt == Q5_K) amx_Q5_K(gp, nbk, xq, dk, bs, K, nt, mr, y, ldy, nvalid);
    else if (qt == Q6_K) amx_Q6_K(gp, nbk, xq, dk, bs, K, nt, mr, y, ldy, nvalid);
    else return 0;
    return 1;
}
#endif
