/* ------------------------------------------------------------------------
 * attention.c's data movement and fixed trees in vector registers: a tile's keys
 * transposed, and the max and sum over a tile's 16 lanes. Each gives the same bits as
 * its plain C form (the transposes move data; the trees combine the same pairs in the
 * same order), so every build computes the same attention.
 * ------------------------------------------------------------------------ */
#ifndef HP_ATT_TILE_H
#define HP_ATT_TILE_H

#include "hp.h"

_Static_assert(HP_TILE == 16, "the trees and transposes below are written for tiles of 16 keys");

#define HP_KT_MAX_D 512  /* head dims up to this transpose keys in registers */

/* Transposes of float32 key rows into kt [D, TILE] (pure data movement: the scores' bits do
 * not depend on how kt is filled). 16 rows of 16 floats (native AVX-512) or 8 of 8 (AVX2,
 * the simulated-width build included) at a time, in registers; plain C otherwise. */
#if defined(__AVX512F__) && !defined(HP_SIM512)
#define KT_W 16
static void kt_block(const float *const *src, int d0, float *kt) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src[i] + d0);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int k = 0; k < 2; k++) {
            const __m512d a = _mm512_castps_pd(t[i + k]), b = _mm512_castps_pd(t[i + k + 2]);
            r[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    for (int h = 0; h < 16; h += 8)
        for (int k = 0; k < 4; k++) {
            t[h + k] = _mm512_shuffle_f32x4(r[h + k], r[h + k + 4], 0x88);
            t[h + k + 4] = _mm512_shuffle_f32x4(r[h + k], r[h + k + 4], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        _mm512_storeu_ps(kt + (size_t)(d0 + k) * HP_TILE, _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88));
        _mm512_storeu_ps(kt + (size_t)(d0 + k + 8) * HP_TILE, _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd));
    }
}
#elif defined(__AVX2__)
#define KT_W 8
static void kt_block(const float *const *src, int d0, float *kt) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src[i] + d0);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_ps(kt + (size_t)(d0 + k) * HP_TILE, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
        _mm256_storeu_ps(kt + (size_t)(d0 + k + 4) * HP_TILE, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
    }
}
#endif

/* The fixed trees over the 16 lanes of t: lane i with lane i + w for w = 8, 4, 2, 1 (the
 * max as a > b ? a : b, which MAXPS is; the sum as +): the same pairs in every build. */
#if defined(__AVX2__)
static inline float tree16_max(const float *t) {
    const __m256 v = _mm256_max_ps(_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}
static inline float tree16_sum(const float *t) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}
#else
static inline float tree16_max(float *t) {
    for (int w = HP_TILE / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] > t[i + w] ? t[i] : t[i + w];
    return t[0];
}
static inline float tree16_sum(float *t) {
    for (int w = HP_TILE / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
    return t[0];
}
#endif

#endif
