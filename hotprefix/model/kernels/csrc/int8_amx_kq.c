/* AMX tiles for the K-quant int8 products (int8_amx.c says how the tiles are used): one
 * tdpbssd a sub-block (Q4_K, Q5_K: 32 values; Q6_K: 16, its codes - 32), its int32 sums
 * scaled by the sub-block's integer scale into the super-block's sum T with vpmulld, then
 * the unit's float steps (kq_scale_vnni): int8_kq.c's integers (for Q6_K, its -32 sum_s
 * sc_s * sum of x's sub-block s folded into the codes) and float order, so its bits.
 */
#include "hp.h"
#include "int8_kq.h"

#if defined(HP_AMX)
#define KQ_RUN 4  /* tiles of x a run: their float sums (4 KB each) stay in L1 across units */

/* Unit u's B tiles (bt: ns sub-blocks of sub * 16 bytes, signed codes) and each sub-block's
 * scales as int32 lanes (sce). */
static inline __attribute__((always_inline)) void kq_unit(const int qtype, const uint8_t *u, uint8_t *bt, __m512i *sce) {
    const int ns = qtype == Q6_K ? 16 : 8, nv = qtype == Q6_K ? 4 : 8;
    for (int s = 0; s < ns; s++) {
        __m512i W[8];
        const int p = s / 2, e = s % 2;
        if (qtype == Q6_K) {
            kq6_codes(u, s, W);
            for (int i = 0; i < 4; i++) W[i] = _mm512_sub_epi8(W[i], _mm512_set1_epi8(32));
            const __m512i scp = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(u + K6_SC + 32 * p)));
            sce[s] = e ? _mm512_srai_epi32(scp, 16) : _mm512_srai_epi32(_mm512_slli_epi32(scp, 16), 16);
        } else {
            kq45_codes(qtype, u, s, W);
            const __m512i scp = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(u + K45_SC + 32 * p)));
            sce[s] = e ? _mm512_srli_epi32(scp, 16) : _mm512_and_si512(scp, _mm512_set1_epi32(0xffff));
        }
        for (int i = 0; i < nv; i++) _mm512_store_si512(bt + 64 * (nv * s + i), W[i]);
    }
}

/* Sub-block s's tile product: C(ct) = A(at) . B(bt_). */
#define KQ_DOT(ct, at, bt_, s) do { _tile_zero(ct); _tile_loadd(at, xq + (size_t)b * QKK + sub * (s), K); \
    _tile_loadd(bt_, bt + 16 * sub * (s), 64); _tile_dpbssd(ct, at, bt_); } while (0)

/* T[r] += C's row r times the sub-block's scales. */
static inline __attribute__((always_inline)) void kq_add(const int32_t *c, __m512i sce, __m512i *T) {
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) T[r] = _mm512_add_epi32(T[r], _mm512_mullo_epi32(_mm512_load_si512(c + 16 * r), sce));
}

/* Unit b (kq_unit's bt, sce) against a tile of 16 rows of x (xq, dk, bs at its first row),
 * its float sums added into acc (16 rows of 16). */
static inline __attribute__((always_inline)) void kq_tile(const int qtype, const uint8_t *u, int b, int nbk,
                                                          const uint8_t *bt, const __m512i *sce, const int8_t *xq,
                                                          const float *dk, const int16_t *bs, int K, float *acc) {
    const int sub = qtype == Q6_K ? 16 : 32, ns = QKK / sub;
    int32_t c[256] __attribute__((aligned(64)));
    __m512i T[16];
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) T[r] = _mm512_setzero_si512();
    KQ_DOT(0, 2, 4, 0);
    for (int s = 0; s < ns; s += 2) {
        KQ_DOT(1, 3, 5, s + 1);
        _tile_stored(0, c, 64);
        kq_add(c, sce[s], T);
        if (s + 2 < ns) KQ_DOT(0, 2, 4, s + 2);
        _tile_stored(1, c, 64);
        kq_add(c, sce[s + 1], T);
    }
    __m512 a[16];
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) a[r] = _mm512_load_ps(acc + 16 * r);
    kq_scale_vnni(qtype, 16, u, T, dk, bs + (size_t)b * KBS, nbk, b, a);
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) _mm512_store_ps(acc + 16 * r, a[r]);
}

/* A group (gp: its nbk units) against nt tiles of x from xk's row 0 (pointers offset). */
static inline __attribute__((always_inline)) void amx_kq_group(
        const int qtype, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk, const int16_t *bs, int K,
        int nt, float *y, int ldy, int nvalid) {
    const int ub = unit_bytes(qtype);
    uint8_t bt[4096] __attribute__((aligned(64)));
    __m512i sce[16];
    float acc[KQ_RUN][256] __attribute__((aligned(64)));
    for (int t0 = 0; t0 < nt; t0 += KQ_RUN) {
        const int tn = nt - t0 < KQ_RUN ? nt - t0 : KQ_RUN;
        memset(acc, 0, sizeof acc);
        for (int b = 0; b < nbk; b++) {
            const uint8_t *u = gp + (size_t)b * ub;
            kq_unit(qtype, u, bt, sce);
            for (int t = 0; t < tn; t++) {
                const size_t m = (size_t)16 * (t0 + t);
                kq_tile(qtype, u, b, nbk, bt, sce, xq + m * K, dk + m * nbk, bs + m * nbk * KBS, K, acc[t]);
            }
        }
        amx_store(acc[0], tn, y + (size_t)16 * t0 * ldy, ldy, nvalid);
    }
}

#define AMX_KQ(T) static void amx_##T(const uint8_t *gp, int nbk, const int8_t *xq, const float *dk, \
        const int16_t *bs, int K, int nt, float *y, int ldy, int nvalid) { \
    amx_kq_group(T, gp, nbk, xq, dk, bs, K, nt, y, ldy, nvalid); }
AMX_KQ(Q4_K)
AMX_KQ(Q5_K)
AMX_KQ(Q6_K)

int amx_kq(const hp_part *pt, int g, int K, int m0, int nt, const xquant *xk, float *y, int ldy, int nvalid) {
    const int qt = pt->qtype, nbk = K / QKK;
    const uint8_t *gp = pt->w + (size_t)g * nbk * unit_bytes(qt);
    const int8_t *xq = xk->q + (size_t)m0 * K;
    const float *dk = xk->d + (size_t)m0 * nbk;
    const int16_t *bs = xk->bs + (size_t)m0 * nbk * KBS;
    amx_config(qt == Q6_K ? 16 : 32);
    if (qt == Q4_K) amx_Q4_K(gp, nbk, xq, dk, bs, K, nt, y, ldy, nvalid);
    else if (qt == Q5_K) amx_Q5_K(gp, nbk, xq, dk, bs, K, nt, y, ldy, nvalid);
    else if (qt == Q6_K) amx_Q6_K(gp, nbk, xq, dk, bs, K, nt, y, ldy, nvalid);
    else return 0;
    return 1;
}
#endif
