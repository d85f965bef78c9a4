/* The small per-row operations of a decoder layer, inline so that decode.c's fused
 * step and ops.c's separate calls run the same code (and give the same bits). */
#ifndef HP_OPS_H
#define HP_OPS_H

#include "hp.h"

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

/* out[i] = silu(g[i]) * g[I + i] for a row g = [gate | up] of 2I floats (the fused
 * gate/up product), silu(x) = x / (1 + e^-x) with exp_nonpos: the MLP's activation in
 * one pass instead of two strided torch ops and a temporary. */
static inline void silu_mul_row(const float *g, int I, float *o) {
    const float *u = g + I;
    #pragma omp simd
    for (int i = 0; i < I; i++) {
        const float x = g[i], e = exp_nonpos(-fabsf(x)), xe = x * e;  /* e^-|x| */
        const float num = x >= 0.0f ? x : xe;  /* a select of values computed anyway: the loop vectorizes */
        o[i] = num / (1.0f + e) * u[i];
    }
}

/* out[i] = gelu_tanh(g[i]) * g[I + i] for a row g = [gate | up] of 2I floats (Gemma's GeGLU):
 * gelu_tanh(x) = x / 2 (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), computed as
 * x / (1 + e^-2u), the same select as silu_mul_row's so that the loop vectorizes. */
static inline void gelu_tanh_mul_row(const float *g, int I, float *o) {
    const float *up = g + I;
    #pragma omp simd
    for (int i = 0; i < I; i++) {
        const float x = g[i], u2 = 1.5957691216057308f * (x + 0.044715f * x * x * x);  /* 2u */
        const float e = exp_nonpos(-fabsf(u2));  /* e^-|2u| */
        const float num = u2 >= 0.0f ? x : x * e;
        o[i] = num / (1.0f + e) * up[i];
    }
}

/* fp8 KV (--kv-cache-dtype fp8, fp8_e5m2): KV_F32 pools hold float32, KV_E4M3 and KV_E5M2
 * pools one byte a value, value / scale rounded as torch's cast rounds. */
enum { KV_F32 = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* The exact float32 value of an fp8 byte (e4m3fn: 4 exponent bits, bias 7, 0x7f/0xff NaN;
 * e5m2: the top byte of an IEEE half). */
static inline float fp8_value(uint8_t b, int kv_type) {
    if (kv_type == KV_E5M2) return fp16_to_fp32((uint16_t)(b << 8));
    const uint32_t s = (uint32_t)(b & 0x80) << 24, e = (b >> 3) & 0xF, m = b & 0x7;
    if (e == 0) return m ? (b & 0x80 ? -1.0f : 1.0f) * (float)m * 0x1p-9f : bits_f32(s);
    if (e == 15 && m == 7) return bits_f32(s | 0x7fc00000u);
    return bits_f32(s | ((e + 120) << 23) | (m << 20));
}

/* float32 -> fp8 byte, rounded to nearest even as torch's CPU cast does: e5m2 as c10's
 * fp8e5m2_from_fp32_value (overflow to infinity); e4m3fn as c10's fp8e4m3fn_from_fp32_value
 * but saturating, as torch's cast does (e4m3fn has no infinity: a magnitude that rounds
 * past 448, infinity included, is 448; NaN stays NaN). */
static inline uint8_t fp8_byte(float f, int kv_type) {
    uint32_t u = f32_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (kv_type == KV_E5M2) {
        if (u >= 143u << 23) r = u > 255u << 23 ? 0x7f : 0x7c;
        else if (u < 113u << 23) r = (uint8_t)(f32_bits(bits_f32(u) + bits_f32(134u << 23)) - (134u << 23));
        else r = (uint8_t)((u + ((uint32_t)(15 - 127) << 23) + 0xFFFFF + ((u >> 21) & 1)) >> 21);
    } else {
        if (u > 255u << 23) r = 0x7f;  /* NaN */
        else if (u >= 1087u << 20) r = 0x7e;
        else if (u < 121u << 23) r = (uint8_t)(f32_bits(bits_f32(u) + bits_f32(141u << 23)) - (141u << 23));
        else r = (uint8_t)((u + ((uint32_t)(7 - 127) << 23) + 0x7FFFF + ((u >> 20) & 1)) >> 20);
        if (r == 0x7f && u <= 255u << 23) r = 0x7e;
    }
    return r | (uint8_t)(sign >> 24);
}

/* Store one token's keys and values (KVH * D each) in an fp8 pool at `slot`: value / scale. */
static inline void kv_write_row_fp8(uint8_t *kpool, uint8_t *vpool, int64_t head_stride, int64_t slot, const float *k,
                                    const float *v, int KVH, int D, int kv_type, float k_scale, float v_scale) {
    for (int h = 0; h < KVH; h++) {
        uint8_t *kd = kpool + h * head_stride + slot * D, *vd = vpool + h * head_stride + slot * D;
        const float *ks = k + (int64_t)h * D, *vs = v + (int64_t)h * D;
        for (int d = 0; d < D; d++) {
            kd[d] = fp8_byte(ks[d] / k_scale, kv_type);
            vd[d] = fp8_byte(vs[d] / v_scale, kv_type);
        }
    }
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

/* The sum of x[e] * y[e] over e < E in one fixed order, whatever the vector width: lane i of
 * 16 adds the products e = i (mod 16) in order, then the 16 lanes are added as a tree
 * (8 pairs, 4, 2, 1). The plain C, AVX2 and AVX-512 builds give the same bits. */
static inline float dot16(const float *x, const float *y, int E) {
    float part[16] = {0};
    int e = 0;
    for (; e + 16 <= E; e += 16) {
        #pragma omp simd
        for (int i = 0; i < 16; i++) part[i] = part[i] + x[e + i] * y[e + i];
    }
    for (; e < E; e++) part[e % 16] = part[e % 16] + x[e] * y[e];
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) part[i] = part[i] + part[i + w];
    return part[0];
}

/* RMSNorm of one row of E floats: o = x / sqrt(mean(x^2) + eps) * w (the sum of squares in
 * dot16's order, so every build and every batch gives the same bits). */
static inline void rmsnorm_row(const float *xr, int E, const float *w, float eps, float *o) {
    const float inv = 1.0f / sqrtf(dot16(xr, xr, E) / (float)E + eps);
    #pragma omp simd
    for (int e = 0; e < E; e++) o[e] = xr[e] * inv * w[e];
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

#endif
