/* The library's interface, stated once: every function it exports and the structs of the
 * fused decode step. model/kernels/abi.py mirrors it (SIGNATURES, the ctypes structs;
 * tests/model/test_kernel_abi.py compares the two, and bind() checks the struct layouts);
 * each .c file that defines one of these functions includes this header, so the compiler
 * checks every definition against it. */
#ifndef HP_API_H
#define HP_API_H

#include <stdint.h>

#include "hp.h"  /* hp_part */

#define HP_KINDS 8  /* attention kinds a step may hold: each its rotary tables, plans and write slots (a window,
                      or a grouped pool's KV-cache group: Gemma 3 has up to seven) */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* One layer's weights (each projection's parts regrouped by hp_repack) and cache. */
typedef struct {
    const float *norm1, *norm2;                     /* [E]: before attention, before the MLP */
    hp_part qkv[3], o, gu[2], down;                 /* rows [(H + 2 KVH) D], [E], [2I], [E] */
    int nqkv, ngu;                                  /* parts of qkv (1-3) and gu (1-2) */
    const float *b_qkv, *b_o;                       /* [(H + 2 KVH) D], [E], or NULL */
    void *kpool, *vpool;                            /* [KVH, S, D] of the stack's kv_type */
    float k_scale, v_scale;                         /* fp8 pools: value = byte's value * scale */
    const float *q_norm, *k_norm;                   /* [D]: each head of q and k normed before RoPE, or NULL */
    const float *post1, *post2;                     /* [E]: the attention's and the MLP's output normed
                                                       before its residual add (Gemma), or NULL */
    int act;                                        /* the MLP's: ACT_SILU, ACT_GELU_TANH */
    int kind;                                       /* its rotary tables, plans and slots in the step: < HP_KINDS */
} hp_layer;

/* The decoder stack: its layers and shape. */
typedef struct {
    const hp_layer *layers;
    int nlayers, E, H, KVH, D, I;
    float eps, scale;
    int64_t head_stride;                            /* values between KV heads of a pool: S * D */
    int kv_type;                                    /* KV_F32, KV_E4M3, KV_E5M2 (ops.h) */
    void (*reduce)(float *x, int64_t n);            /* over tensor-parallel ranks: x [n] summed over them in
                                                       place (o's and down's partial products); NULL alone */
} hp_stack;

/* An attention plan (attention.c): ntasks tasks of T_FIELDS int64 each, (first entry of
 * rows, entries, first entry of slots, position of that slot, KV head, flags ATT_INIT /
 * ATT_FINAL); rows [R]: each query's row of q viewed [*, D] (and of out and the state);
 * lims [R, 2]: each query's key positions [lo, hi); slots: pool slots in position order. */
typedef struct {
    const int64_t *rows, *lims, *task, *slots;
    int ntasks;
} hp_plan;

/* What an attention pass reads and writes: q [*, D] rows; a layer's pools [KVH, S, D]
 * (kv_type KV_F32: float32; KV_E4M3, KV_E5M2: one byte a value, times k_scale / v_scale);
 * out [*, D]; the state of rows between passes, m and l [*], acc [*, D] (read by ATT_INIT
 * tasks, written by tasks without ATT_FINAL; NULL when none has). */
typedef struct {
    const float *q;
    const void *k, *v;
    int64_t head_stride;                            /* values between KV heads of a pool: S * D */
    int KVH, D, kv_type;
    float scale, k_scale, v_scale;
    float *out, *st_m, *st_l, *st_acc;
} hp_att;

/* One decode step. x [M, E]: the rows' hidden states, updated in place through the
 * layers. Per attention kind (a layer's `kind`): cos, sin [M, D] (rope()'s halves), wslots
 * [M]: where each row's key and value go (a grouped pool's group: its own blocks), own:
 * the attention plan over each row's keys (rows indexing q as [M * H, D]), shared: the
 * cascades' shared prefixes (ntasks 0: none), run first, whose saved state own's
 * ATT_INIT tasks continue. A kind no layer has may be left NULL and empty. */
typedef struct {
    float *x;
    const float *cos_[HP_KINDS], *sin_[HP_KINDS];
    const int64_t *wslots[HP_KINDS];
    hp_plan own[HP_KINDS], shared[HP_KINDS];
    int M;
} hp_step;

/* A mixture's experts: each projection as expert 0's rows (regrouped by hp_repack expert by
 * expert when int8, else GGUF blocks or F32 rows as stored) and the bytes from one expert's
 * rows to the next's; gate and up [X, I, E], down [X, E, I]. */
typedef struct {
    hp_part gate, up, down;
    int64_t gate_stride, up_stride, down_stride;
    int X, E, I, int8;
} hp_moe;

/* products and weights (blocks.c, int8.c, repack.c) */
int hp_qmatmul(int qtype, const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads);
int hp_dequantize(int qtype, const uint8_t *w, int N, int K, float *out);
int hp_qmatmul_i8(int qtype, const float *x, int M, int K, const uint8_t *wp, int N, float *y, int nthreads);
int hp_qmatmul_i8_parts(const hp_part *parts, int nparts, const float *x, int M, int K, float *y, int nthreads);
int hp_repack(int qtype, const uint8_t *w, int N, int K, uint8_t *out);
long hp_repacked_bytes(int qtype, int N, int K);
int hp_int8_vectorized(void);
int hp_vector_paths(void);
int hp_amx(int want);  /* int8_amx.c: AMX tiles on (1) or off (0) where granted, -1 asks; returns whether on */

/* attention and the per-row operations (attention.c, ops.c) */
int hp_attend(const hp_att *a, const hp_plan *plan, int nthreads);
void hp_silu_mul(const float *gu, int M, int I, float *out, int nthreads);
void hp_gelu_tanh_mul(const float *gu, int M, int I, float *out, int nthreads);
void hp_kv_write(float *kpool, float *vpool, int64_t head_stride, const int64_t *slots, int T, const float *k,
                 int64_t k_row, const float *v, int64_t v_row, int KVH, int D);
void hp_kv_write_fp8(uint8_t *kpool, uint8_t *vpool, int64_t head_stride, const int64_t *slots, int T,
                     const float *k, int64_t k_row, const float *v, int64_t v_row, int KVH, int D, int kv_type,
                     float k_scale, float v_scale);
void hp_rmsnorm(const float *x, int M, int E, int64_t x_row, const float *w, float eps, float *out, int nthreads);
void hp_rope(float *x, int T, int nh, int64_t x_row, int D, const float *cos_, const float *sin_, int nthreads);

/* prompt logprobs: each row's target logprob, rank and top k over the full vocabulary (score.c) */
void hp_score_rows(const float *logits, int R, int V, const int64_t *targets, int k, float *lp, int64_t *rank,
                   int64_t *top_ids, float *top_lp, int nthreads);
/* the same from hidden states x [M, K] on an int8 head (one part), its logits never written out */
int hp_score_head(const hp_part *part, const float *x, int M, int K, const int64_t *targets, int k, float *lp,
                  int64_t *rank, int64_t *top_ids, float *top_lp, int nthreads);

/* a mixture's expert FFNs, tokens grouped by expert (moe.c) */
int hp_moe_ffn(const hp_moe *m, const float *x, int T, const int64_t *ids, const float *w, int k, float *out,
               int64_t *reads, int nthreads);

/* the fused decode step and the struct layouts (decode.c) */
int hp_decode_layers(const hp_stack *s, const hp_step *st, int nthreads);
int hp_struct_layout(int which, int64_t *out);

/* shared by attention.c and decode.c */
int max_task_rows(const hp_plan *p);
int plan_valid(const hp_plan *p, int KVH);
void attend_task(const hp_att *a, const hp_plan *pl, int t, const att_scratch *scr);
void att_scratch_fp8(const att_scratch *a, const hp_att *att);

#endif
