/* int8 activations (what llama.cpp does): each row of x is quantized to int8, per 32
 * values for the 32-value block types and per 256 for the K-quants, with one float scale
 * a block (dx = max|x| / 127, xq = round-half-even(x * 127 / max|x|)), and multiplied
 * with integer dot products on repack.c's layouts by the group kernels (int8_q32.c,
 * int8_kq.c). A product has one to HP_MAX_PARTS parts: weights of any types over the
 * same input whose outputs are consecutive columns (q, k and v of a Q4_K_M layer are
 * Q4_K, Q4_K and Q6_K), computed in one work-sharing loop.
 */
#include "hp.h"
#include "hp_api.h"

#define M_CHUNK 64  /* rows of x whose int8 form (M_CHUNK * K bytes) stays in L2 while the groups pass */

/* Whether the int8 path runs on vector instructions in this build (AVX-512 VNNI or AVX2;
 * else plain C). */
int hp_int8_vectorized(void) {
#if defined(HP_I512) || defined(HP_I256)
    return 1;
#else
    return 0;
#endif
}

/* The vector paths this build compiled, as bits: 1 float work on 512 bits, 2 on 256 bits,
 * 4 int8 products on AVX-512 VNNI, 8 on AVX2, 16 the simulated AVX-512 (tests), 32 AMX
 * tiles for 16 rows of x at a time (while on: hp_amx); 0: plain C. */
int hp_vector_paths(void) {
    int bits = 0;
#if defined(HP_F512)
    bits |= 1;
#elif defined(HP_F256)
    bits |= 2;
#endif
#if defined(HP_I512)
    bits |= 4;
#elif defined(HP_I256)
    bits |= 8;
#endif
#if defined(HP_SIM512)
    bits |= 16;
#endif
    if (amx_on()) bits |= 32;
    return bits;
}

/* max |x[k]| over n values (a multiple of 16), NaN ignored as the scalar `a > m ? a : m`
 * ignores it (max_ps returns its second operand when the first is a NaN): the same value
 * on every path; on vectors, since the scalar loop's carried compare does not vectorize
 * (it was most of quantizing x: ~4 cycles a value). */
static float abs_max(const float *x, int n) {
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), m);
    return _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < n; k += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), m);
    float t[8], r = 0.0f;
    _mm256_storeu_ps(t, m);
    for (int i = 0; i < 8; i++) r = t[i] > r ? t[i] : r;
    return r;
#else
    float amax = 0.0f;
    for (int k = 0; k < n; k++) { const float a = fabsf(x[k]); amax = a > amax ? a : amax; }
    return amax;
#endif
}

/* Per 32 values: xq, dx, xsum = sum of xq, sx = dx * sum of xq. */
static void quantize_row(const float *x, int K, int8_t *xq, float *dx, int32_t *xsum, float *sx) {
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        const float amax = abs_max(xb, QK);
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

/* Per 256 values: xq, dx, and KBS int16 sums of xq (16 per 16 values, then 8 per 32). */
static void quantize_row_k(const float *x, int K, int8_t *xq, float *dx, int16_t *bs) {
    for (int b = 0; b < K / QKK; b++) {
        const float *xb = x + (size_t)b * QKK;
        int8_t *qb = xq + (size_t)b * QKK;
        int16_t *s = bs + (size_t)b * KBS;
        const float amax = abs_max(xb, QKK);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < QKK; k++) {
            int q = (int)nearbyintf(xb[k] * id);
            qb[k] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
        }
        for (int i = 0; i < 16; i++) {
            int sum = 0;
            for (int k = 0; k < 16; k++) sum += qb[16 * i + k];
            s[i] = (int16_t)sum;
        }
        for (int i = 0; i < 8; i++) s[16 + i] = (int16_t)(s[2 * i] + s[2 * i + 1]);
        dx[b] = amax / 127.0f;
    }
}

/* Row xr (K values) quantized into row m of x32 (per 32 values, need32) and of xk (per
 * 256, needk). */
void xquant_row(const float *xr, int K, int m, int need32, int needk, xquant *x32, xquant *xk) {
    if (need32) {
        const int nb = K / QK;
        quantize_row(xr, K, x32->q + (size_t)m * K, x32->d + (size_t)m * nb, x32->sum + (size_t)m * nb,
                     x32->sd + (size_t)m * nb);
    }
    if (needk) {
        const int nbk = K / QKK;
        quantize_row_k(xr, K, xk->q + (size_t)m * K, xk->d + (size_t)m * nbk, xk->bs + (size_t)m * nbk * KBS);
    }
}

/* For a thread of an enclosing parallel region (a work-sharing loop, ending in a
 * barrier): rows 0..M-1 of x [*, K] quantized (xquant_row); row m reads x's row src[m]
 * (src NULL: row m). */
void xquant_rows(const float *x, const int *src, int M, int K, int need32, int needk, xquant *x32, xquant *xk) {
    if (!need32 && !needk) return;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) xquant_row(x + (size_t)(src ? src[m] : m) * K, K, m, need32, needk, x32, xk);
}

/* Scratch for M rows of K values, and 15 rows of zeros past them: a partial AMX tile
 * (amx_group_rows) reads up to 15 rows past the last row it stores. */
int xquant_alloc(xquant *x, int M, int K) {
    const size_t rows = (size_t)(M > 0 ? M : 1) + 15, nb = (size_t)K / QK + 1, nbk = (size_t)K / QKK + 1;
    x->q = calloc(rows * (size_t)K + 1, 1);
    x->d = calloc(rows * nb, sizeof(float));
    x->sum = calloc(rows * nb, sizeof(int32_t));
    x->sd = calloc(rows * nb, sizeof(float));
    x->bs = calloc(rows * nbk * KBS, sizeof(int16_t));
    return x->q && x->d && x->sum && x->sd && x->bs;
}

void xquant_free(xquant *x) { free(x->q); free(x->d); free(x->sum); free(x->sd); free(x->bs); }

/* Whether every part has an int8 layout, rows, and a K that its blocks divide. */
int parts_valid(const hp_part *parts, int nparts, int K) {
    if (nparts < 1 || nparts > HP_MAX_PARTS || K <= 0) return 0;
    for (int p = 0; p < nparts; p++)
        if (!unit_bytes(parts[p].qtype) || K % block_values(parts[p].qtype) || parts[p].n <= 0) return 0;
    return 1;
}

/* One group (16 rows of one part) against rows m0..m1 of x: by AMX tiles where it is on and
 * there are at least 16 rows (amx_group_rows), else by the group kernels. yg: y at row m0 and
 * the group's first column; rows ldy apart. */
void i8_group_rows(const hp_part *pt, int g, int ldy, int K, int m0, int m1, const xquant *x32, const xquant *xk,
                   float *yg) {
    const int done = amx_group_rows(pt, g, ldy, K, m0, m1, x32, xk, yg);
    yg += (size_t)done * ldy;
    m0 += done;
    const int nvalid = pt->n - g * G < G ? pt->n - g * G : G;
    if (k_family(pt->qtype)) {
        const int nbk = K / QKK, step = group_kq_rows();
        const uint8_t *gp = pt->w + (size_t)g * nbk * unit_bytes(pt->qtype);
        for (int m = m0; m < m1; m += step) {
            const int mt = m1 - m < step ? m1 - m : step;
            group_kq(pt->qtype, mt, gp, nbk, xk->q + (size_t)m * K, xk->d + (size_t)m * nbk,
                     xk->bs + (size_t)m * nbk * KBS, K, yg + (size_t)(m - m0) * ldy, ldy, nvalid, m == m0);
        }
    } else {
        const int nb = K / QK, step = group_q32_rows();
        const uint8_t *gp = pt->w + (size_t)g * nb * unit_bytes(pt->qtype);
        for (int m = m0; m < m1; m += step) {
            const int mt = m1 - m < step ? m1 - m : step;
            const size_t xo = (size_t)m * nb;
            group_q32(pt->qtype, mt, gp, nb, x32->q + (size_t)m * K, x32->d + xo, x32->sum + xo, x32->sd + xo, K,
                      yg + (size_t)(m - m0) * ldy, ldy, nvalid);
        }
    }
}

/* The body of the int8 product for a thread of an enclosing parallel region (its
 * work-sharing loops end in barriers, so every thread calls it with the same arguments):
 * quantizes x [M, K] for the block families the parts need (into x32 / xk, scratch of
 * xquant_alloc(M, K)), then every thread takes groups of 16 weight rows of the parts.
 * y [M, sum of the parts' n]. The caller checks parts_valid. */
void qmm_i8_team(const hp_part *parts, int nparts, const float *x, int M, int K, float *y,
                 xquant *x32, xquant *xk) {
    int gstart[HP_MAX_PARTS + 1], col[HP_MAX_PARTS], need32 = 0, needk = 0, ldy = 0;
    gstart[0] = 0;
    for (int p = 0; p < nparts; p++) {
        if (k_family(parts[p].qtype)) needk = 1; else need32 = 1;
        col[p] = ldy;
        ldy += parts[p].n;
        gstart[p + 1] = gstart[p] + (parts[p].n + G - 1) / G;
    }
    xquant_rows(x, NULL, M, K, need32, needk, x32, xk);
    /* (rows of x in chunks of M_CHUNK, groups): a chunk's int8 rows stay in cache while
     * the groups pass over them, instead of all of x streaming past every group */
    const int chunks = (M + M_CHUNK - 1) / M_CHUNK, groups = gstart[nparts];
    #pragma omp for schedule(static) collapse(2)
    for (int c = 0; c < chunks; c++)
    for (int gg = 0; gg < groups; gg++) {
        int p = 0;
        while (gg >= gstart[p + 1]) p++;
        const int m_end = (c + 1) * M_CHUNK < M ? (c + 1) * M_CHUNK : M;
        i8_group_rows(parts + p, gg - gstart[p], ldy, K, c * M_CHUNK, m_end, x32, xk,
                      y + col[p] + (size_t)(gg - gstart[p]) * G + (size_t)c * M_CHUNK * ldy);
    }
    amx_release();
}

/* y[M, sum of n] = x[M, K] @ [W_0; W_1; ...]^T with x quantized to int8; each part
 * regrouped by hp_repack. Returns 0; -1 for an invalid part (type, K, n); -2 when out
 * of memory. */
int hp_qmatmul_i8_parts(const hp_part *parts, int nparts, const float *x, int M, int K, float *y, int nthreads) {
    if (!parts_valid(parts, nparts, K)) return -1;
    if (M <= 0) return 0;
    xquant x32, xk;
    const int ok32 = xquant_alloc(&x32, M, K), okk = xquant_alloc(&xk, M, K);
    if (ok32 && okk) {
        #pragma omp parallel num_threads(nthreads)
        qmm_i8_team(parts, nparts, x, M, K, y, &x32, &xk);
    }
    xquant_free(&x32);
    xquant_free(&xk);
    return ok32 && okk ? 0 : -2;
}

/* The one-part form: y[M, N] = x[M, K] @ W^T, W regrouped by hp_repack. */
int hp_qmatmul_i8(int qtype, const float *x, int M, int K, const uint8_t *wp, int N, float *y, int nthreads) {
    const hp_part part = {wp, qtype, N};
    return hp_qmatmul_i8_parts(&part, 1, x, M, K, y, nthreads);
}
