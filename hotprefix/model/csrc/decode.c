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
 * (rmsnorm_row, qmm_i8_team, rope_row, attend_task, silu_mul_row), in the same order
 * with the same additions, so the result is the same bits as the layer-by-layer path.
 * ------------------------------------------------------------------------ */

/* Row r of attention over two disjoint key sets, combined exactly (attention.py's _merge):
 * o[r] <- o_sh[r] e^(l_sh - L) + o[r] e^(l - L), L = log(e^l_sh + e^l), for D floats. */
static inline void merge_row(float *o, const float *lse, const float *osh, const float *lsh, int64_t r, int D) {
    const float a = lsh[r], b = lse[r], m = a > b ? a : b;
    const float L = m + log1pf(expf(-fabsf(a - b)));
    const float wa = expf(a - L), wb = expf(b - L);
    float *orow = o + r * D;
    const float *srow = osh + r * D;
    for (int d = 0; d < D; d++) orow[d] = srow[d] * wa + orow[d] * wb;
}

/* sizeof and the field offsets, in declaration order, of hp_api.h's structs (which: 0
 * hp_part, 1 hp_layer, 2 hp_stack, 3 hp_step) into out (room for 32); returns how many
 * were written. qlinear.bind compares them with its ctypes mirrors. */
int hp_struct_layout(int which, int64_t *out) {
#define F(T, f) out[n++] = (int64_t)offsetof(T, f)
    int n = 0;
    switch (which) {
        case 0: out[n++] = sizeof(hp_part); F(hp_part, w); F(hp_part, qtype); F(hp_part, n); break;
        case 1: out[n++] = sizeof(hp_layer); F(hp_layer, norm1); F(hp_layer, norm2); F(hp_layer, qkv); F(hp_layer, o);
                F(hp_layer, gu); F(hp_layer, down); F(hp_layer, nqkv); F(hp_layer, ngu); F(hp_layer, b_qkv);
                F(hp_layer, b_o); F(hp_layer, kpool); F(hp_layer, vpool); break;
        case 2: out[n++] = sizeof(hp_stack); F(hp_stack, layers); F(hp_stack, nlayers); F(hp_stack, E);
                F(hp_stack, H); F(hp_stack, KVH); F(hp_stack, D); F(hp_stack, I); F(hp_stack, eps);
                F(hp_stack, scale); F(hp_stack, head_stride); break;
        case 3: out[n++] = sizeof(hp_step); F(hp_step, x); F(hp_step, cos_); F(hp_step, sin_); F(hp_step, wslots);
                F(hp_step, rows); F(hp_step, task); F(hp_step, aslots); F(hp_step, srows); F(hp_step, stask);
                F(hp_step, sslots); F(hp_step, M); F(hp_step, ntasks); F(hp_step, nsrows); F(hp_step, nstasks); break;
        default: break;
    }
#undef F
    return n;
}

static int stack_valid(const hp_stack *s) {
    const int HD = s->H * s->D;
    for (int l = 0; l < s->nlayers; l++) {
        const hp_layer *ly = s->layers + l;
        int nqkv = 0, ngu = 0;
        for (int p = 0; p < ly->nqkv && p < 3; p++) nqkv += ly->qkv[p].n;
        for (int p = 0; p < ly->ngu && p < 2; p++) ngu += ly->gu[p].n;
        if (ly->nqkv > 3 || ly->ngu > 2 || !parts_valid(ly->qkv, ly->nqkv, s->E) || !parts_valid(&ly->o, 1, HD)
            || !parts_valid(ly->gu, ly->ngu, s->E) || !parts_valid(&ly->down, 1, s->I)
            || nqkv != (s->H + 2 * s->KVH) * s->D || ngu != 2 * s->I || ly->o.n != s->E || ly->down.n != s->E)
            return 0;
    }
    return 1;
}

/* One layer for a thread of the step's parallel region (every thread runs it: its
 * work-sharing loops end in barriers). */
static void layer_team(const hp_stack *s, const hp_layer *ly, const hp_step *st, float *h, float *qkv, float *qb,
                       float *o, float *lse, float *osh, float *lsh, float *tmp, float *gu, float *act, xquant *x32,
                       xquant *xk, const att_scratch *scr, int ok) {
    const int M = st->M, E = s->E, H = s->H, KVH = s->KVH, D = s->D, I = s->I, HD = H * D;
    const int NQKV = (H + 2 * KVH) * D;
    float *x = st->x;
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) rmsnorm_row(x + (size_t)m * E, E, ly->norm1, s->eps, h + (size_t)m * E);
    qmm_i8_team(ly->qkv, ly->nqkv, h, M, E, qkv, x32, xk);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        float *r = qkv + (size_t)m * NQKV;
        if (ly->b_qkv) for (int j = 0; j < NQKV; j++) r[j] = r[j] + ly->b_qkv[j];
        rope_row(r, H, D, st->cos_ + (size_t)m * D, st->sin_ + (size_t)m * D);
        rope_row(r + HD, KVH, D, st->cos_ + (size_t)m * D, st->sin_ + (size_t)m * D);
        memcpy(qb + (size_t)m * HD, r, sizeof(float) * HD);
        kv_write_row(ly->kpool, ly->vpool, s->head_stride, st->wslots[m], r + HD, r + HD + KVH * D, KVH, D);
    }
    #pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < st->ntasks; t++)
        if (ok) attend_task(qb, st->rows, st->task + 5 * t, ly->kpool, ly->vpool, s->head_stride, D, st->aslots,
                            s->scale, o, lse, scr);
    if (st->nstasks) {  /* the same for every thread: without cascades, no extra barriers */
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < st->nstasks; t++)
            if (ok) attend_task(qb, st->srows, st->stask + 5 * t, ly->kpool, ly->vpool, s->head_stride, D,
                                st->sslots, s->scale, osh, lsh, scr);
        #pragma omp for schedule(static)
        for (int i = 0; i < st->nsrows; i++) merge_row(o, lse, osh, lsh, st->srows[i], D);
    }
    qmm_i8_team(&ly->o, 1, o, M, HD, tmp, x32, xk);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        float *xr = x + (size_t)m * E, *tr = tmp + (size_t)m * E;
        if (ly->b_o) for (int e = 0; e < E; e++) xr[e] = xr[e] + (tr[e] + ly->b_o[e]);
        else for (int e = 0; e < E; e++) xr[e] = xr[e] + tr[e];
        rmsnorm_row(xr, E, ly->norm2, s->eps, h + (size_t)m * E);
    }
    qmm_i8_team(ly->gu, ly->ngu, h, M, E, gu, x32, xk);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) silu_mul_row(gu + (size_t)m * 2 * I, I, act + (size_t)m * I);
    qmm_i8_team(&ly->down, 1, act, M, I, tmp, x32, xk);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        float *xr = x + (size_t)m * E, *tr = tmp + (size_t)m * E;
        for (int e = 0; e < E; e++) xr[e] = xr[e] + tr[e];
    }
}

/* Runs the step `st` through every layer of `s` (updating st->x and writing the step's
 * keys and values into the pools). Returns 0; -1 for a projection whose parts do not
 * fit the shape (type, K, rows); -2 when out of memory. */
int hp_decode_layers(const hp_stack *s, const hp_step *st, int nthreads) {
    if (!stack_valid(s)) return -1;
    const int M = st->M, E = s->E, H = s->H, D = s->D, I = s->I, HD = H * D, NQKV = (H + 2 * s->KVH) * D;
    const int kmax = E > HD ? (E > I ? E : I) : (HD > I ? HD : I);
    float *h = malloc(sizeof(float) * (size_t)M * E), *qkv = malloc(sizeof(float) * (size_t)M * NQKV);
    float *qb = malloc(sizeof(float) * (size_t)M * HD), *o = malloc(sizeof(float) * (size_t)M * HD);
    float *lse = malloc(sizeof(float) * (size_t)M * H), *tmp = malloc(sizeof(float) * (size_t)M * E);
    float *osh = malloc(sizeof(float) * (size_t)M * HD), *lsh = malloc(sizeof(float) * (size_t)M * H);
    float *gu = malloc(sizeof(float) * (size_t)M * 2 * I), *act = malloc(sizeof(float) * (size_t)M * I);
    xquant x32, xk;
    const int okq = xquant_alloc(&x32, M, kmax) & xquant_alloc(&xk, M, kmax);
    int failed = !(h && qkv && qb && o && lse && tmp && osh && lsh && gu && act && okq);
    const int maxr_own = max_task_rows(st->task, st->ntasks), maxr_sh = max_task_rows(st->stask, st->nstasks);
    const int maxr = maxr_own > maxr_sh ? maxr_own : maxr_sh;
    if (!failed) {
        #pragma omp parallel num_threads(nthreads) reduction(|:failed)
        {
            att_scratch scr;
            const int ok = att_scratch_alloc(&scr, maxr, D);  /* a thread without it still meets every barrier */
            if (!ok) failed = 1;
            for (int l = 0; l < s->nlayers; l++)
                layer_team(s, s->layers + l, st, h, qkv, qb, o, lse, osh, lsh, tmp, gu, act, &x32, &xk, &scr, ok);
            att_scratch_free(&scr);
        }
    }
    free(h); free(qkv); free(qb); free(o); free(lse); free(tmp); free(osh); free(lsh); free(gu); free(act);
    xquant_free(&x32);
    xquant_free(&xk);
    return failed ? -2 : 0;
}
