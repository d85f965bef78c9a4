#include <stddef.h>

#include "ops.h"
#include "hp_api.h"

/* ------------------------------------------------------------------------
 * Every decoder layer of a decode step in one call and one parallel region.
 *
 * A decode step of M single-token rows (no prefill) otherwise makes ~10
 * calls per layer from Python, each with its own parallel region, plus torch's small
 * ops between them. Here the threads stay in one region for all layers and meet at the
 * work-sharing loops' barriers. Each stage is the same code as the separate calls
 * (rmsnorm_row, qmm_i8_team, rope_row, attend_task, silu_mul_row / gelu_tanh_mul_row), in
 * the same order with the same additions, so the result is the same bits as the
 * layer-by-layer path. Gemma's layers take the optional stages: q/k norms per head, norms
 * of the attention's and the MLP's outputs, GeGLU, a kind of their own (local or global:
 * its rotary tables and plans; in a grouped pool, one kind per KV-cache group, whose
 * plans read and whose slots write that group's blocks).
 * ------------------------------------------------------------------------ */

/* sizeof and the field offsets, in declaration order, of hp_api.h's structs (which: 0
 * hp_part, 1 hp_layer, 2 hp_stack, 3 hp_step, 4 hp_plan, 5 hp_att, 6 hp_moe) into out
 * (room for 32); returns how many were written. kernels/abi.bind compares them with its
 * ctypes mirrors. */
int hp_struct_layout(int which, int64_t *out) {
#define F(T, f) out[n++] = (int64_t)offsetof(T, f)
    int n = 0;
    switch (which) {
        case 0: out[n++] = sizeof(hp_part); F(hp_part, w); F(hp_part, qtype); F(hp_part, n); break;
        case 1: out[n++] = sizeof(hp_layer); F(hp_layer, norm1); F(hp_layer, norm2); F(hp_layer, qkv); F(hp_layer, o);
                F(hp_layer, gu); F(hp_layer, down); F(hp_layer, nqkv); F(hp_layer, ngu); F(hp_layer, b_qkv);
                F(hp_layer, b_o); F(hp_layer, kpool); F(hp_layer, vpool); F(hp_layer, k_scale); F(hp_layer, v_scale);
                F(hp_layer, q_norm); F(hp_layer, k_norm); F(hp_layer, post1); F(hp_layer, post2); F(hp_layer, act);
                F(hp_layer, kind); break;
        case 2: out[n++] = sizeof(hp_stack); F(hp_stack, layers); F(hp_stack, nlayers); F(hp_stack, E);
                F(hp_stack, H); F(hp_stack, KVH); F(hp_stack, D); F(hp_stack, I); F(hp_stack, eps);
                F(hp_stack, scale); F(hp_stack, head_stride); F(hp_stack, kv_type); F(hp_stack, reduce); break;
        case 3: out[n++] = sizeof(hp_step); F(hp_step, x); F(hp_step, cos_); F(hp_step, sin_); F(hp_step, wslots);
                F(hp_step, own); F(hp_step, shared); F(hp_step, M); break;
        case 4: out[n++] = sizeof(hp_plan); F(hp_plan, rows); F(hp_plan, lims); F(hp_plan, task); F(hp_plan, slots);
                F(hp_plan, ntasks); break;
        case 5: out[n++] = sizeof(hp_att); F(hp_att, q); F(hp_att, k); F(hp_att, v); F(hp_att, head_stride);
                F(hp_att, KVH); F(hp_att, D); F(hp_att, kv_type); F(hp_att, scale); F(hp_att, k_scale);
                F(hp_att, v_scale); F(hp_att, out); F(hp_att, st_m); F(hp_att, st_l); F(hp_att, st_acc); break;
        case 6: out[n++] = sizeof(hp_moe); F(hp_moe, gate); F(hp_moe, up); F(hp_moe, down); F(hp_moe, gate_stride);
                F(hp_moe, up_stride); F(hp_moe, down_stride); F(hp_moe, X); F(hp_moe, E); F(hp_moe, I);
                F(hp_moe, int8); break;
        default: break;
    }
#undef F
    return n;
}

/* The stack's projections fit its shape, and every layer's kind has its tables and slots in the step. */
static int stack_valid(const hp_stack *s, const hp_step *st) {
    const int HD = s->H * s->D;
    if (s->kv_type < KV_F32 || s->kv_type > KV_E5M2) return 0;
    for (int l = 0; l < s->nlayers; l++) {
        const hp_layer *ly = s->layers + l;
        int nqkv = 0, ngu = 0;
        for (int p = 0; p < ly->nqkv && p < 3; p++) nqkv += ly->qkv[p].n;
        for (int p = 0; p < ly->ngu && p < 2; p++) ngu += ly->gu[p].n;
        if (ly->kind < 0 || ly->kind >= HP_KINDS || ly->act < ACT_SILU || ly->act > ACT_GELU_TANH) return 0;
        if (!st->cos_[ly->kind] || !st->sin_[ly->kind] || !st->wslots[ly->kind]) return 0;
        if (ly->nqkv > 3 || ly->ngu > 2 || !parts_valid(ly->qkv, ly->nqkv, s->E) || !parts_valid(&ly->o, 1, HD)
            || !parts_valid(ly->gu, ly->ngu, s->E) || !parts_valid(&ly->down, 1, s->I)
            || nqkv != (s->H + 2 * s->KVH) * s->D || ngu != 2 * s->I || ly->o.n != s->E || ly->down.n != s->E)
            return 0;
    }
    return 1;
}

/* The step's scratch, per row: h [E], qkv [NQKV], qb and o [HD], tmp [E], gu [2I], act [I];
 * with cascades, the attention state between the shared and the own pass. */
typedef struct { float *h, *qkv, *qb, *o, *tmp, *gu, *act, *st_m, *st_l, *st_acc; } step_buf;

/* The attention of one layer for a thread of the step's parallel region: the cascades'
 * shared prefixes first (their state saved), then every row's own keys. */
static void attention_team(const hp_stack *s, const hp_layer *ly, const hp_step *st, const step_buf *b,
                           const att_scratch *scr, int ok) {
    const hp_att a = {b->qb, ly->kpool, ly->vpool, s->head_stride, s->KVH, s->D, s->kv_type, s->scale, ly->k_scale,
                      ly->v_scale, b->o, b->st_m, b->st_l, b->st_acc};
    const hp_plan *own = &st->own[ly->kind], *shared = &st->shared[ly->kind];
    if (ok) att_scratch_fp8(scr, &a);  /* (each thread its own tables: no barrier needed) */
    if (shared->ntasks) {  /* the same for every thread: without cascades, no extra barrier */
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < shared->ntasks; t++)
            if (ok) attend_task(&a, shared, t, scr);
    }
    #pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < own->ntasks; t++)
        if (ok) attend_task(&a, own, t, scr);
}

/* A row's q, k and v after the product: the bias, each head of q and k normed (q_norm,
 * k_norm), rotated by the layer's kind's tables, q kept and k, v written to the pool. */
static void qkv_row(const hp_stack *s, const hp_layer *ly, const hp_step *st, const step_buf *b, int m) {
    const int H = s->H, KVH = s->KVH, D = s->D, HD = H * D, NQKV = (H + 2 * KVH) * D;
    float *r = b->qkv + (size_t)m * NQKV;
    const float *c = st->cos_[ly->kind] + (size_t)m * D, *sn = st->sin_[ly->kind] + (size_t)m * D;
    if (ly->b_qkv) for (int j = 0; j < NQKV; j++) r[j] = r[j] + ly->b_qkv[j];
    if (ly->q_norm) {
        for (int h = 0; h < H; h++) rmsnorm_row(r + (size_t)h * D, D, ly->q_norm, s->eps, r + (size_t)h * D);
        for (int h = 0; h < KVH; h++) rmsnorm_row(r + HD + (size_t)h * D, D, ly->k_norm, s->eps, r + HD + (size_t)h * D);
    }
    rope_row(r, H, D, c, sn);
    rope_row(r + HD, KVH, D, c, sn);
    memcpy(b->qb + (size_t)m * HD, r, sizeof(float) * HD);
    if (s->kv_type == KV_F32)
        kv_write_row(ly->kpool, ly->vpool, s->head_stride, st->wslots[ly->kind][m], r + HD, r + HD + KVH * D, KVH, D);
    else
        kv_write_row_fp8(ly->kpool, ly->vpool, s->head_stride, st->wslots[ly->kind][m], r + HD, r + HD + KVH * D, KVH, D,
                         s->kv_type, ly->k_scale, ly->v_scale);
}

/* x[m] += out[m] (+ bias), out first normed by `post` where there is one (in place). */
static void residual_row(float *xr, float *tr, const float *bias, const float *post, int E, float eps) {
    if (post) rmsnorm_row(tr, E, post, eps, tr);
    if (bias) for (int e = 0; e < E; e++) xr[e] = xr[e] + (tr[e] + bias[e]);
    else for (int e = 0; e < E; e++) xr[e] = xr[e] + tr[e];
}

/* A row-parallel product's out [M, E] (each rank's partial sums) summed over the
 * tensor-parallel ranks by the stack's reduce (none alone): the thread that entered
 * hp_decode_layers calls it (the caller's own thread, as the callback may need) after the
 * product's barrier, the others wait at the next. */
static void reduce_team(const hp_stack *s, float *out, int64_t n) {
    if (!s->reduce) return;
    #pragma omp master
    s->reduce(out, n);
    #pragma omp barrier
}

/* One layer for a thread of the step's parallel region (every thread runs it: its
 * work-sharing loops end in barriers). */
static void layer_team(const hp_stack *s, const hp_layer *ly, const hp_step *st, const step_buf *b, xquant *x32,
                       xquant *xk, const att_scratch *scr, int ok) {
    const int M = st->M, E = s->E, HD = s->H * s->D, I = s->I;
    float *x = st->x;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) rmsnorm_row(x + (size_t)m * E, E, ly->norm1, s->eps, b->h + (size_t)m * E);
    qmm_i8_team(ly->qkv, ly->nqkv, b->h, M, E, b->qkv, x32, xk);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) qkv_row(s, ly, st, b, m);
    attention_team(s, ly, st, b, scr, ok);
    qmm_i8_team(&ly->o, 1, b->o, M, HD, b->tmp, x32, xk);
    reduce_team(s, b->tmp, (int64_t)M * E);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        float *xr = x + (size_t)m * E;
        residual_row(xr, b->tmp + (size_t)m * E, ly->b_o, ly->post1, E, s->eps);
        rmsnorm_row(xr, E, ly->norm2, s->eps, b->h + (size_t)m * E);
    }
    qmm_i8_team(ly->gu, ly->ngu, b->h, M, E, b->gu, x32, xk);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        if (ly->act == ACT_GELU_TANH) gelu_tanh_mul_row(b->gu + (size_t)m * 2 * I, I, b->act + (size_t)m * I);
        else silu_mul_row(b->gu + (size_t)m * 2 * I, I, b->act + (size_t)m * I);
    }
    qmm_i8_team(&ly->down, 1, b->act, M, I, b->tmp, x32, xk);
    reduce_team(s, b->tmp, (int64_t)M * E);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) residual_row(x + (size_t)m * E, b->tmp + (size_t)m * E, NULL, ly->post2, E, s->eps);
}

/* The step's buffers (see step_buf); returns 0 when one could not be had. */
static int step_buf_alloc(step_buf *b, const hp_stack *s, int M) {
    const size_t E = s->E, HD = (size_t)s->H * s->D, I = s->I, NQKV = (size_t)(s->H + 2 * s->KVH) * s->D;
    b->h = malloc(sizeof(float) * M * E);
    b->qkv = malloc(sizeof(float) * M * NQKV);
    b->qb = malloc(sizeof(float) * M * HD);
    b->o = malloc(sizeof(float) * M * HD);
    b->tmp = malloc(sizeof(float) * M * E);
    b->gu = malloc(sizeof(float) * M * 2 * I);
    b->act = malloc(sizeof(float) * M * I);
    b->st_m = malloc(sizeof(float) * M * s->H);
    b->st_l = malloc(sizeof(float) * M * s->H);
    b->st_acc = malloc(sizeof(float) * M * HD);
    return b->h && b->qkv && b->qb && b->o && b->tmp && b->gu && b->act && b->st_m && b->st_l && b->st_acc;
}

static void step_buf_free(step_buf *b) {
    free(b->h); free(b->qkv); free(b->qb); free(b->o); free(b->tmp); free(b->gu); free(b->act);
    free(b->st_m); free(b->st_l); free(b->st_acc);
}

/* Runs the step `st` through every layer of `s` (updating st->x and writing the step's
 * keys and values into the pools). Returns 0; -1 for a projection whose parts do not
 * fit the shape (type, K, rows), a layer's kind without its tables or slots, or an invalid
 * attention plan; -2 when out of memory. */
int hp_decode_layers(const hp_stack *s, const hp_step *st, int nthreads) {
    if (!stack_valid(s, st)) return -1;
    int maxr = 1;
    for (int k = 0; k < HP_KINDS; k++) {
        if (!plan_valid(&st->own[k], s->KVH) || !plan_valid(&st->shared[k], s->KVH)) return -1;
        const int ro = max_task_rows(&st->own[k]), rs = max_task_rows(&st->shared[k]);
        maxr = ro > maxr ? ro : maxr;
        maxr = rs > maxr ? rs : maxr;
    }
    const int M = st->M, E = s->E, HD = s->H * s->D, I = s->I;
    const int kmax = E > HD ? (E > I ? E : I) : (HD > I ? HD : I);
    step_buf b;
    xquant x32, xk;
    const int okq = xquant_alloc(&x32, M, kmax) & xquant_alloc(&xk, M, kmax);
    int failed = !(step_buf_alloc(&b, s, M) && okq);
    if (!failed) {
        #pragma omp parallel num_threads(nthreads) reduction(|:failed)
        {
            att_scratch scr;
            const int ok = att_scratch_alloc(&scr, maxr, s->D);  /* a thread without it still meets every barrier */
            if (!ok) failed = 1;
            for (int l = 0; l < s->nlayers; l++) layer_team(s, s->layers + l, st, &b, &x32, &xk, &scr, ok);
            att_scratch_free(&scr);
        }
    }
    step_buf_free(&b);
    xquant_free(&x32);
    xquant_free(&xk);
    return failed ? -2 : 0;
}
