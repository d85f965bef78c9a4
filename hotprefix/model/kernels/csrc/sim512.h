/* The AVX-512 (F, BW, VNNI) intrinsics the kernels use, in plain C: test builds only
 * (kernels/build.build_library(defines=("HP_SIM512",)), on an x86-64-v3 build). It lets the
 * 512-bit code paths run, and be compared bit for bit with the AVX2 and plain C paths,
 * on CPUs without AVX-512. Each function follows Intel's definition of the instruction;
 * _mm512_reduce_add_ps adds in the order of GCC's implementation. Included by hp.h
 * after <immintrin.h>: the macros below rename the intrinsics and types of the code
 * that follows, not the compiler's own declarations.
 */
#ifndef HP_SIM512_H
#define HP_SIM512_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { float f[16]; } sim_m512;
typedef union { int8_t b[64]; uint8_t ub[64]; int16_t h[32]; int32_t i[16]; uint32_t ui[16]; } sim_m512i;
typedef uint16_t sim_mask16;
#define __m512 sim_m512
#define __m512i sim_m512i
#define __mmask16 sim_mask16

#define SIM_F(name) static inline __attribute__((unused))

SIM_F(setzero_ps) sim_m512 sim_setzero_ps(void) { sim_m512 r; memset(&r, 0, sizeof r); return r; }
SIM_F(setzero_si512) sim_m512i sim_setzero_si512(void) { sim_m512i r; memset(&r, 0, sizeof r); return r; }
SIM_F(set1_ps) sim_m512 sim_set1_ps(float v) { sim_m512 r; for (int k = 0; k < 16; k++) r.f[k] = v; return r; }
SIM_F(set1_epi32) sim_m512i sim_set1_epi32(int v) { sim_m512i r; for (int k = 0; k < 16; k++) r.i[k] = v; return r; }
SIM_F(set1_epi8) sim_m512i sim_set1_epi8(char v) { sim_m512i r; for (int k = 0; k < 64; k++) r.b[k] = (int8_t)v; return r; }
SIM_F(loadu_ps) sim_m512 sim_loadu_ps(const void *p) { sim_m512 r; memcpy(&r, p, 64); return r; }
SIM_F(loadu_si512) sim_m512i sim_loadu_si512(const void *p) { sim_m512i r; memcpy(&r, p, 64); return r; }
SIM_F(storeu_ps) void sim_storeu_ps(void *p, sim_m512 a) { memcpy(p, &a, 64); }
SIM_F(mask_storeu_ps) void sim_mask_storeu_ps(void *p, sim_mask16 k, sim_m512 a) {
    for (int j = 0; j < 16; j++) if ((k >> j) & 1) memcpy((float *)p + j, &a.f[j], 4);
}

#define SIM_FLOAT2(name, expr) SIM_F(name) sim_m512 sim_##name(sim_m512 a, sim_m512 b) { \
    sim_m512 r; for (int k = 0; k < 16; k++) r.f[k] = (expr); return r; }
SIM_FLOAT2(add_ps, a.f[k] + b.f[k])
SIM_FLOAT2(sub_ps, a.f[k] - b.f[k])
SIM_FLOAT2(mul_ps, a.f[k] * b.f[k])
SIM_F(fmadd_ps) sim_m512 sim_fmadd_ps(sim_m512 a, sim_m512 b, sim_m512 c) {
    sim_m512 r; for (int k = 0; k < 16; k++) r.f[k] = fmaf(a.f[k], b.f[k], c.f[k]); return r;
}
SIM_F(reduce_add_ps) float sim_reduce_add_ps(sim_m512 a) {
    float t3[8], t6[4];
    for (int k = 0; k < 8; k++) t3[k] = a.f[8 + k] + a.f[k];
    for (int k = 0; k < 4; k++) t6[k] = t3[4 + k] + t3[k];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

#define SIM_INT2(name, lanes, expr) SIM_F(name) sim_m512i sim_##name(sim_m512i a, sim_m512i b) { \
    sim_m512i r; for (int k = 0; k < lanes; k++) expr; return r; }
SIM_INT2(and_si512, 16, r.ui[k] = a.ui[k] & b.ui[k])
SIM_INT2(or_si512, 16, r.ui[k] = a.ui[k] | b.ui[k])
SIM_INT2(xor_si512, 16, r.ui[k] = a.ui[k] ^ b.ui[k])
SIM_INT2(add_epi32, 16, r.ui[k] = a.ui[k] + b.ui[k])
SIM_INT2(sub_epi32, 16, r.ui[k] = a.ui[k] - b.ui[k])
SIM_INT2(mullo_epi32, 16, r.ui[k] = a.ui[k] * b.ui[k])
SIM_INT2(madd_epi16, 16, r.ui[k] = (uint32_t)((int32_t)a.h[2 * k] * b.h[2 * k]) + (uint32_t)((int32_t)a.h[2 * k + 1] * b.h[2 * k + 1]))

SIM_F(dpbusd_epi32) sim_m512i sim_dpbusd_epi32(sim_m512i src, sim_m512i a, sim_m512i b) {
    sim_m512i r;
    for (int k = 0; k < 16; k++) {
        uint32_t s = src.ui[k];
        for (int t = 0; t < 4; t++) s += (uint32_t)((int32_t)a.ub[4 * k + t] * b.b[4 * k + t]);
        r.ui[k] = s;
    }
    return r;
}

#define SIM_SHIFT(name, lanes, field, expr) SIM_F(name) sim_m512i sim_##name(sim_m512i a, unsigned int c) { \
    sim_m512i r; for (int k = 0; k < lanes; k++) r.field[k] = (expr); return r; }
SIM_SHIFT(slli_epi16, 32, h, (int16_t)(c > 15 ? 0 : (uint16_t)((uint16_t)a.h[k] << c)))
SIM_SHIFT(srli_epi16, 32, h, (int16_t)(c > 15 ? 0 : (uint16_t)a.h[k] >> c))
SIM_SHIFT(slli_epi32, 16, ui, c > 31 ? 0 : a.ui[k] << c)
SIM_SHIFT(srli_epi32, 16, ui, c > 31 ? 0 : a.ui[k] >> c)
SIM_SHIFT(srai_epi32, 16, i, c > 31 ? (a.i[k] < 0 ? -1 : 0) : a.i[k] >> c)

SIM_F(cvtepi32_ps) sim_m512 sim_cvtepi32_ps(sim_m512i a) {
    sim_m512 r; for (int k = 0; k < 16; k++) r.f[k] = (float)a.i[k]; return r;
}
SIM_F(cvtph_ps) sim_m512 sim_cvtph_ps(__m256i h) {
    uint16_t v[16]; memcpy(v, &h, 32);
    sim_m512 r; for (int k = 0; k < 16; k++) r.f[k] = _cvtsh_ss(v[k]); return r;
}
SIM_F(cvtepi8_epi32) sim_m512i sim_cvtepi8_epi32(__m128i a) {
    int8_t v[16]; memcpy(v, &a, 16); sim_m512i r; for (int k = 0; k < 16; k++) r.i[k] = v[k]; return r;
}
SIM_F(cvtepu8_epi32) sim_m512i sim_cvtepu8_epi32(__m128i a) {
    uint8_t v[16]; memcpy(v, &a, 16); sim_m512i r; for (int k = 0; k < 16; k++) r.i[k] = v[k]; return r;
}
SIM_F(cvtepi8_epi16) sim_m512i sim_cvtepi8_epi16(__m256i a) {
    int8_t v[32]; memcpy(v, &a, 32); sim_m512i r; for (int k = 0; k < 32; k++) r.h[k] = v[k]; return r;
}
SIM_F(cvtepu8_epi16) sim_m512i sim_cvtepu8_epi16(__m256i a) {
    uint8_t v[32]; memcpy(v, &a, 32); sim_m512i r; for (int k = 0; k < 32; k++) r.h[k] = v[k]; return r;
}

#define _mm512_setzero_ps sim_setzero_ps
#define _mm512_setzero_si512 sim_setzero_si512
#define _mm512_set1_ps sim_set1_ps
#define _mm512_set1_epi32 sim_set1_epi32
#define _mm512_set1_epi8 sim_set1_epi8
#define _mm512_loadu_ps sim_loadu_ps
#define _mm512_loadu_si512 sim_loadu_si512
#define _mm512_storeu_ps sim_storeu_ps
#define _mm512_mask_storeu_ps sim_mask_storeu_ps
#define _mm512_add_ps sim_add_ps
#define _mm512_sub_ps sim_sub_ps
#define _mm512_mul_ps sim_mul_ps
#define _mm512_fmadd_ps sim_fmadd_ps
#define _mm512_reduce_add_ps sim_reduce_add_ps
#define _mm512_and_si512 sim_and_si512
#define _mm512_or_si512 sim_or_si512
#define _mm512_xor_si512 sim_xor_si512
#define _mm512_add_epi32 sim_add_epi32
#define _mm512_sub_epi32 sim_sub_epi32
#define _mm512_mullo_epi32 sim_mullo_epi32
#define _mm512_madd_epi16 sim_madd_epi16
#define _mm512_dpbusd_epi32 sim_dpbusd_epi32
#define _mm512_slli_epi16 sim_slli_epi16
#define _mm512_srli_epi16 sim_srli_epi16
#define _mm512_slli_epi32 sim_slli_epi32
#define _mm512_srli_epi32 sim_srli_epi32
#define _mm512_srai_epi32 sim_srai_epi32
#define _mm512_cvtepi32_ps sim_cvtepi32_ps
#define _mm512_cvtph_ps sim_cvtph_ps
#define _mm512_cvtepi8_epi32 sim_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 sim_cvtepu8_epi32
#define _mm512_cvtepi8_epi16 sim_cvtepi8_epi16
#define _mm512_cvtepu8_epi16 sim_cvtepu8_epi16

#endif
