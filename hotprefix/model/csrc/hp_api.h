/* The library's interface, stated once: every function it exports and the structs of the
 * fused decode step. model/kernel_abi.py mirrors it (SIGNATURES, the ctypes structs;
 * tests/model/test_kernel_abi.py compares the two, and bind() checks the struct layouts);
 * each .c file that defines one of these functions includes this header, so the compiler
 * checks every definition against it. */
#ifndef HP_API_H
#define HP_API_H

#include <stdint.h>

#include "hp.h"  /* hp_part */

/* One layer's weights (each projection's parts regrouped by hp_repack) and cache. */
typedef struct {
    const float *norm1, *norm2;                     /* [E] */
    hp_part qkv[3], o, gu[2], down;                 /* rows [(H + 2 KVH) D], [E], [2I], [E] */
    int nqkv, ngu;                                  /* parts of qkv (1-3) and gu (1-2) */
    const float *b_qkv, *b_o;                       /* [(H + 2 KVH) D], [E], or NULL */
    float *kpool, *vpool;                           /* [KVH, S, D] */
} hp_layer;

/* The decoder stack: its layers and shape. */
typedef struct {
    const hp_layer *layers;
    int nlayers, E, H, KVH, D, I;
    float eps, scale;
    int64_t head_stride;                            /* floats between KV heads of a pool: S * D */
} hp_stack;

/* One decode step. x [M, E]: the rows' hidden states, updated in place through the
 * layers. cos, sin: [M, D] (rope()'s halves); wslots [M]: where each row's key and value
 * go; rows, task, ntasks, aslots: the attention plan over each row's own context
 * (hp_paged_attention's, with rows indexing q as [M * H, D]); srows, stask, nstasks,
 * sslots: the plan over the cascades' shared prefixes (nsrows rows, each in one task;
 * nstasks 0: none), whose output is merged into those rows' by log-sum-exp (merge_row). */
typedef struct {
    float *x;
    const float *cos_, *sin_;
    const int64_t *wslots, *rows, *task, *aslots, *srows, *stask, *sslots;
    int M, ntasks, nsrows, nstasks;
} hp_step;

/* products and weights (blocks.c, int8.c, repack.c) */
int hp_qmatmul(int qtype, const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads);
int hp_dequantize(int qtype, const uint8_t *w, int N, int K, float *out);
int hp_qmatmul_i8(int qtype, const float *x, int M, int K, const uint8_t *wp, int N, float *y, int nthreads);
int hp_qmatmul_i8_parts(const hp_part *parts, int nparts, const float *x, int M, int K, float *y, int nthreads);
int hp_repack(int qtype, const uint8_t *w, int N, int K, uint8_t *out);
long hp_repacked_bytes(int qtype, int N, int K);
int hp_int8_vectorized(void);

/* attention and the per-row operations (attention.c, ops.c) */
int hp_paged_attention(const float *q, const int64_t *rows, const int64_t *task, int ntasks,
                       const float *kpool, const float *vpool, int64_t head_stride, int D,
                       const int64_t *slots, float scale, float *out, float *lse, int nthreads);
void hp_silu_mul(const float *gu, int M, int I, float *out, int nthreads);
void hp_kv_write(float *kpool, float *vpool, int64_t head_stride, const int64_t *slots, int T, const float *k,
                 int64_t k_row, const float *v, int64_t v_row, int KVH, int D);
void hp_rmsnorm(const float *x, int M, int E, int64_t x_row, const float *w, float eps, float *out, int nthreads);
void hp_rope(float *x, int T, int nh, int64_t x_row, int D, const float *cos_, const float *sin_, int nthreads);

/* the fused decode step and the struct layouts (decode.c) */
int hp_decode_layers(const hp_stack *s, const hp_step *st, int nthreads);
int hp_struct_layout(int which, int64_t *out);

#endif
