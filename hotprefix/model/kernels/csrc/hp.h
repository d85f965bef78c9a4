/* What the kernel files share: GGUF block types, fp16, the vector paths this build
 * compiles, and the scratch that int8 activations live in.
 *
 * The files, compiled together into one library (kernels/build.build_library):
 *   blocks.c     GGUF blocks as stored: dequantization, float32 products (float32 mode)
 *   repack.c     the regrouped layouts of the int8 products
 *   int8.c       activations to int8, the product team loop, its entry points
 *   int8_q32.c   int8 group kernels of the 32-value block types
 *   int8_kq.c    int8 group kernels of the 256-value K-quant types
 *   int8_amx.c   AMX tiles for 16 rows of x at a time, 32-value types (int8_amx_kq.c: K-quants)
 *   attention.c  paged attention over the KV pool
 *   ops.c        RMSNorm, RoPE, silu * up, KV writes (ops.h: their row functions)
 *   decode.c     every decoder layer of a decode step in one call
 *   score.c      prompt logprobs: each row's target logprob, rank and top k
 *   moe.c        a mixture's expert FFNs, tokens grouped by expert
 */
#ifndef HP_H
#define HP_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(HP_SIM512)
#include "sim512.h" /* test builds only: the AVX-512 intrinsics in plain C, on an AVX2 CPU */
#endif

/* The vector paths of this build. Float work (dequantization, attention): 512 or 256
 * bits. int8 products: VNNI on 512 bits, else AVX2's vpmaddubsw, else plain C. */
#if defined(HP_SIM512) || defined(__AVX512F__)
#define HP_F512 1
#elif defined(__AVX2__)
#define HP_F256 1
#endif
#if defined(HP_SIM512) || (defined(__AVX512F__) && defined(__AVX512VNNI__))
#define HP_I512 1
#elif defined(__AVX2__)
#define HP_I256 1
#endif
/* AMX tiles for the int8 products of 16 rows of x at a time (int8_amx.c): compiled where
 * the compiler targets them (-march=native on a CPU with amx_int8), unless HP_NO_AMX;
 * used where the kernel grants them (hp_amx). */
#if defined(HP_I512) && !defined(HP_SIM512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(HP_NO_AMX)
#define HP_AMX 1
#endif

/* This build's float vector, for register tiles: VF_W lanes (none: plain C). */
#if defined(HP_F512)
typedef __m512 vf;
#define VF_W 16
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_fma _mm512_fmadd_ps
#define vf_hsum _mm512_reduce_add_ps
#elif defined(HP_F256)
typedef __m256 vf;
#define VF_W 8
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_fma _mm256_fmadd_ps
static inline float vf_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* 16 float lanes whatever the build (one 512-bit vector, two 256-bit ones, or an array):
 * a dot product over k whose lane i adds the products k = i (mod 16) in order, then the
 * lanes added as a tree (i + 8, i + 4, i + 2, i + 1): the same bits in every build. */
#if defined(HP_F512)
typedef struct { __m512 a; } v16;
static inline v16 v16_zero(void) { v16 r = {_mm512_setzero_ps()}; return r; }
static inline v16 v16_load(const float *p) { v16 r = {_mm512_loadu_ps(p)}; return r; }
static inline v16 v16_fmav(v16 w, v16 x, v16 acc) { acc.a = _mm512_fmadd_ps(w.a, x.a, acc.a); return acc; }
static inline v16 v16_fma(const float *w, const float *x, v16 acc) {
    acc.a = _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc.a);
    return acc;
}
#elif defined(HP_F256)
typedef struct { __m256 a, b; } v16;
static inline v16 v16_zero(void) { v16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
static inline v16 v16_load(const float *p) { v16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline v16 v16_fmav(v16 w, v16 x, v16 acc) {
    acc.a = _mm256_fmadd_ps(w.a, x.a, acc.a);
    acc.b = _mm256_fmadd_ps(w.b, x.b, acc.b);
    return acc;
}
static inline v16 v16_fma(const float *w, const float *x, v16 acc) {
    acc.a = _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc.a);
    acc.b = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8), _mm256_loadu_ps(x + 8), acc.b);
    return acc;
}
#else
typedef struct { float f[16]; } v16;
static inline v16 v16_zero(void) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = 0.0f; return r; }
static inline v16 v16_load(const float *p) { v16 r; memcpy(r.f, p, sizeof r.f); return r; }
static inline v16 v16_fmav(v16 w, v16 x, v16 acc) {
    for (int i = 0; i < 16; i++) acc.f[i] = fmaf(w.f[i], x.f[i], acc.f[i]);
    return acc;
}
static inline v16 v16_fma(const float *w, const float *x, v16 acc) {
    for (int i = 0; i < 16; i++) acc.f[i] = fmaf(w[i], x[i], acc.f[i]);
    return acc;
}
#endif

static inline float v16_hsum(v16 v) {
    float t[16];
#if defined(HP_F512)
    _mm512_storeu_ps(t, v.a);
#elif defined(HP_F256)
    _mm256_storeu_ps(t, v.a);
    _mm256_storeu_ps(t + 8, v.b);
#else
    memcpy(t, v.f, sizeof t);
#endif
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i] + t[i + w];
    return t[0];
}

#if defined(HP_F256)
/* The 8 outputs of half `half` (rows 8 half .. 8 half + 7) of a group's row of y; of the
 * group's 16 columns only the first nvalid exist. (The AVX2 int8 kernels' store.) */
static inline void store_half(float *yrow, int half, int nvalid, __m256 v) {
    if (8 * half + 8 <= nvalid) { _mm256_storeu_ps(yrow + 8 * half, v); return; }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int j = 0; j < 8 && 8 * half + j < nvalid; j++) yrow[8 * half + j] = tmp[j];
}
#endif

#if defined(HP_I512)
/* A 4-bit unit's 4 code chunks (repack.c) as bytes: W[i] values 4i..4i+3, W[4 + i]
 * values 16 + 4i .. 16 + 4i + 3 of every row. */
static inline __attribute__((always_inline)) void nibble_codes(const uint8_t *codes, __m512i *W) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < 4; i++) {
        const __m512i p = _mm512_loadu_si512(codes + 64 * i);
        W[i] = _mm512_and_si512(p, mask);
        W[i + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
    }
}
#endif

#define QK 32      /* values in a block of the 32-value types */
#define QKK 256    /* values in a super-block of the K-quant types */
#define G 16       /* weight rows per group of the regrouped (int8) layouts */

/* GGML type ids (F32: float32 rows, read as blocks of 32 values by float32 mode's products) */
enum { F32 = 0, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* Bytes of one GGUF block of `qtype` (0: a type these kernels do not read). */
static inline int block_bytes(int qtype) {
    switch (qtype) {
        case F32: return 128;
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}

/* Values in one block of `qtype`. */
static inline int block_values(int qtype) { return qtype >= Q4_K ? QKK : QK; }

/* Whether int8 products of `qtype` quantize activations per 256 values (the K-quants)
 * rather than per 32. */
static inline int k_family(int qtype) { return qtype >= Q4_K; }

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

static inline float load_fp16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return fp16_to_fp32(h); }

/* Rows of x quantized to int8 for one block family (int8.c's quantize_rows):
 * 32-value family: per 32 values a scale d, the sum of the codes and d * that sum;
 * K family: per 256 values a scale d, and int16 sums of the codes per 16 values (16 of
 * them) then per 32 values (8), 24 a super-block. */
typedef struct {
    int8_t *q;      /* [M, K] */
    float *d;       /* [M, K / block values] */
    int32_t *sum;   /* [M, K / 32] (32-value family) */
    float *sd;      /* [M, K / 32] (32-value family) */
    int16_t *bs;    /* [M, K / 256 * 24] (K family) */
} xquant;

#define KBS 24  /* int16 block sums a super-block of quantized x: 16 per 16 values, 8 per 32 */

/* One weight of a product, regrouped (repack.c): its GGUF type, rows, and bytes. The
 * parts of a fused product share K and write consecutive columns of y. */
typedef struct {
    const uint8_t *w;
    int qtype;
    int n;
} hp_part;

#define HP_MAX_PARTS 4

/* int8.c */
int xquant_alloc(xquant *x, int M, int K);
void xquant_free(xquant *x);
void xquant_row(const float *xr, int K, int m, int need32, int needk, xquant *x32, xquant *xk);
void xquant_rows(const float *x, const int *src, int M, int K, int need32, int needk, xquant *x32, xquant *xk);
void qmm_i8_team(const hp_part *parts, int nparts, const float *x, int M, int K, float *y, xquant *x32, xquant *xk);
int parts_valid(const hp_part *parts, int nparts, int K);
/* one group (16 rows of a part) against rows m0..m1-1 of quantized x, into yg (y at row m0
 * and the group's first column; rows ldy apart) */
void i8_group_rows(const hp_part *pt, int g, int ldy, int K, int m0, int m1, const xquant *x32, const xquant *xk,
                   float *yg);

/* int8_amx.c: whether AMX tiles are on (hp_amx); a group (as i8_group_rows) against the
 * rows m0..m1-1 in tiles of 16 (the last one partial) by AMX where it covers the group's
 * type and there are at least 16 rows; returns the rows it did (0 when off, uncovered or
 * fewer than 16) */
int amx_on(void);  /* amx_group_rows leaves the thread's tiles configured: amx_release after its loop */
int amx_group_rows(const hp_part *pt, int g, int ldy, int K, int m0, int m1, const xquant *x32, const xquant *xk,
                   float *yg);
void amx_release(void);  /* the calling thread's tiles released, if configured */
#if defined(HP_AMX)
void amx_load_config(const uint8_t rows[8], const uint16_t colsb[8]);  /* tile t: rows[t] x colsb[t] bytes */
void amx_store(const float *acc, int tn, int rows, float *y, int ldy, int nvalid);
/* int8_amx_kq.c: the K-quant group g of pt against nt tiles of xk's rows from m0 (y at row
 * m0 and the group's first column); 0 for a type it does not cover */
int amx_kq(const hp_part *pt, int g, int K, int m0, int nt, int mr, const xquant *xk, float *y, int ldy, int nvalid);
#endif

/* blocks.c: weight row `row` (its index n in y's columns) against rows m0 .. m0 + mt - 1
 * of float32 x [*, K] (mt <= F32_RM): y[m * N + n] = x[m] . w, a 16-lane dot product */
#if defined(HP_F512)
#define F32_RM 16  /* rows of x a pass over a weight row takes: their 16-lane sums stay in registers */
#else
#define F32_RM 6
#endif
void f32_row_pass(int qtype, const float *x, int m0, int mt, int K, const uint8_t *row, int n, float *y, int N);

/* group kernels (int8_q32.c, int8_kq.c): one group of 16 weight rows against mt rows of
 * quantized x, written to y (row stride ldy), nvalid of the 16 columns kept; `stream`
 * (K-quants): the first pass over the group's units, which come from memory, not cache. */
void group_q32(int qtype, int mt, const uint8_t *gp, int nb, const int8_t *xq, const float *dx,
               const int32_t *xsum, const float *sx, int K, float *y, int ldy, int nvalid);
void group_kq(int qtype, int mt, const uint8_t *gp, int nbk, const int8_t *xq, const float *dk,
              const int16_t *bs, int K, float *y, int ldy, int nvalid, int stream);
int group_q32_rows(void);  /* rows of x per call of the vector kernels (all when plain C) */
int group_kq_rows(void);

/* repack.c: bytes of one regrouped unit (16 rows x one block) */
int unit_bytes(int qtype);

/* attention.c */
#define HP_TILE 16             /* keys a tile, tiles aligned to absolute positions */
#define HP_MAX_TASK_ROWS 256   /* query rows an attention task may hold */
enum { ATT_INIT = 1, ATT_FINAL = 2 };  /* a task's flags: start from saved state; write the output */
typedef struct { float *acc, *s, *kt, *mx, *l, *vrow, *lut; } att_scratch;  /* lut: fp8 K then V values */
int att_scratch_alloc(att_scratch *a, int maxr, int D);
void att_scratch_free(att_scratch *a);
#endif
