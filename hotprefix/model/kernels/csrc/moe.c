/* A mixture of experts' FFNs, its router's choices given: every token's k experts,
 * out[t] = sum over its experts e of w[t, e] * down_e(silu(gate_e x[t]) * up_e x[t]).
 *
 * The step's (token, expert) slots are sorted by expert (tokens in order within one), so
 * that each chosen expert's weights are read once a step for all the tokens that chose it,
 * and no other expert's are read at all. Experts are taken in waves of consecutive
 * experts (at most WAVE_ROWS slots, or one expert with more), each in five stages split
 * at barriers: the slots' input rows (int8: quantized); gate and up (tasks of 16 rows of
 * one expert); silu(gate) * up; down; the weighted sum into each token's row.
 *
 * Every product is the dense path's (int8: i8_group_rows on regrouped blocks; float32:
 * f32_row_pass on GGUF or F32 rows), whose result for a row does not depend on the rows
 * beside it, and each token's expert outputs are added in ascending expert order, so a
 * token's output is a function of its own row and choices only: the same bits whatever
 * the other tokens of its step (batch invariance).
 */
#include "ops.h"
#include "hp_api.h"

#define WAVE_ROWS 512  /* slots a wave holds: h [WAVE_ROWS, 2I] and y [WAVE_ROWS, E] stay small */

/* The step's slots sorted by expert, and the waves they are taken in. */
typedef struct {
    int *start;   /* [X + 1]: expert e's slots are start[e] .. start[e + 1] - 1 */
    int *tok;     /* [P]: each sorted slot's token */
    float *wt;    /* [P]: its router weight */
    char *first;  /* [P]: whether it is its token's first slot (lowest expert): it starts the sum */
    int *used;    /* [nused]: the experts with slots, ascending */
    int *wave;    /* [nwaves + 1]: wave i takes used[wave[i]] .. used[wave[i + 1] - 1] */
    int nused, nwaves, rows;  /* rows: the most slots of one wave */
} moe_plan;

/* The wave's buffers: its input rows (float32 mode), h [R, 2I], act [R, I], y [R, E],
 * and the quantized rows of the int8 products (x, then act). */
typedef struct { float *xs, *h, *act, *y; xquant x32, xk; } moe_buf;

static void plan_free(moe_plan *pl) {
    free(pl->start); free(pl->tok); free(pl->wt); free(pl->first); free(pl->used); free(pl->wave);
}

/* The waves: consecutive used experts while their slots fit WAVE_ROWS (an expert with
 * more is a wave alone). */
static void plan_waves(moe_plan *pl) {
    int rows = 0;
    pl->nwaves = 0;
    pl->rows = 0;
    for (int u = 0; u < pl->nused; u++) {
        const int e = pl->used[u], c = pl->start[e + 1] - pl->start[e];
        if (u == 0 || rows + c > WAVE_ROWS) {
            pl->wave[pl->nwaves++] = u;
            rows = 0;
        }
        rows += c;
        pl->rows = rows > pl->rows ? rows : pl->rows;
    }
    pl->wave[pl->nwaves] = pl->nused;
}

/* Sort the T * k slots by expert. Returns 0, -2 when out of memory, -3 for an expert id
 * outside 0..X-1. */
static int plan_build(moe_plan *pl, const int64_t *ids, const float *w, int T, int k, int X) {
    const int P = T * k;
    pl->start = calloc((size_t)X + 1, sizeof(int));
    pl->tok = malloc(sizeof(int) * P);
    pl->wt = malloc(sizeof(float) * P);
    pl->used = malloc(sizeof(int) * X);
    pl->wave = malloc(sizeof(int) * ((size_t)X + 1));
    pl->first = malloc(P);
    if (!pl->start || !pl->tok || !pl->wt || !pl->used || !pl->wave || !pl->first) return -2;
    for (int p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= X) return -3;
        pl->start[ids[p] + 1]++;
    }
    pl->nused = 0;
    for (int e = 0; e < X; e++) {
        if (pl->start[e + 1]) pl->used[pl->nused++] = e;
        pl->start[e + 1] += pl->start[e];
    }
    int *fill = pl->wave;  /* a cursor per expert, before the waves are written there */
    memcpy(fill, pl->start, sizeof(int) * X);
    for (int p = 0; p < P; p++) {
        const int q = fill[ids[p]]++, base = p - p % k;
        int at = base;  /* the token's first slot of its lowest expert: the first its sum adds */
        for (int r = base + 1; r < base + k; r++) at = ids[r] < ids[at] ? r : at;
        pl->tok[q] = p / k;
        pl->wt[q] = w[p];
        pl->first[q] = p == at;
    }
    plan_waves(pl);
    return 0;
}

static int buf_alloc(moe_buf *b, const hp_moe *m, int R) {
    const size_t E = m->E, I = m->I;
    b->xs = m->int8 ? NULL : malloc(sizeof(float) * R * E);
    b->h = malloc(sizeof(float) * R * 2 * I);
    b->act = malloc(sizeof(float) * R * I);
    b->y = malloc(sizeof(float) * R * E);
    const int okq = !m->int8 || (xquant_alloc(&b->x32, R, m->E > m->I ? m->E : m->I)
                                 & xquant_alloc(&b->xk, R, m->E > m->I ? m->E : m->I));
    return okq && b->h && b->act && b->y && (m->int8 || b->xs);
}

static void buf_free(moe_buf *b, const hp_moe *m) {
    free(b->xs); free(b->h); free(b->act); free(b->y);
    if (m->int8) { xquant_free(&b->x32); xquant_free(&b->xk); }
}

/* Bytes of an expert's [n, K] rows in its stored form (regrouped when int8), or 0 for
 * a type or K the mode does not read. */
static long expert_bytes(const hp_part *p, int K, int int8) {
    if (int8) return parts_valid(p, 1, K) ? hp_repacked_bytes(p->qtype, p->n, K) : 0;
    if (!block_bytes(p->qtype) || K <= 0 || K % block_values(p->qtype) || p->n <= 0) return 0;
    return (long)p->n * (K / block_values(p->qtype)) * block_bytes(p->qtype);
}

static int moe_valid(const hp_moe *m) {
    const long g = expert_bytes(&m->gate, m->E, m->int8), u = expert_bytes(&m->up, m->E, m->int8);
    const long d = expert_bytes(&m->down, m->I, m->int8);
    return m->X > 0 && m->gate.n == m->I && m->up.n == m->I && m->down.n == m->E && g && u && d
        && m->gate_stride >= g && m->up_stride >= u && m->down_stride >= d;
}

/* Rows 16g .. 16g + 15 of expert e's projection p ([n, K], its columns from col on in
 * y's rows of ldy) against rows m0..m1-1 of the wave's input (x32/xk quantized, or xf
 * float32). Returns the weight bytes read. */
static long expert_group(const hp_part *p, int64_t stride, int e, int g, int col, int ldy, int K, int m0, int m1,
                         const moe_buf *b, const float *xf, float *y, int int8) {
    const hp_part pe = {p->w + (size_t)e * stride, p->qtype, p->n};
    const long unit = (long)(K / block_values(p->qtype)) * (int8 ? unit_bytes(p->qtype) : block_bytes(p->qtype));
    if (int8) {
        i8_group_rows(&pe, g, ldy, K, m0, m1, &b->x32, &b->xk, y + col + (size_t)g * G + (size_t)m0 * ldy);
        return unit;
    }
    const int n1 = 16 * g + 16 < p->n ? 16 * g + 16 : p->n;
    for (int n = 16 * g; n < n1; n++)
        for (int r = m0; r < m1; r += F32_RM)
            f32_row_pass(p->qtype, xf, r, m1 - r < F32_RM ? m1 - r : F32_RM, K, pe.w + (size_t)n * unit, n, y + col,
                         ldy);
    return unit * (n1 - 16 * g);
}

/* One projection stage of a wave for a thread of the region: every (expert, group)
 * task of `parts` (gate and up: 2; down: 1), over the wave's rows of each expert. */
static void wave_products(const hp_moe *m, const moe_plan *pl, int w, const hp_part *parts, const int64_t *strides,
                          int nparts, int K, const float *xf, float *y, const moe_buf *b, int64_t *reads) {
    const int n = parts[0].n, groups = (n + 15) / 16, per = groups * nparts, ldy = n * nparts;
    const int u0 = pl->wave[w], tasks = (pl->wave[w + 1] - u0) * per, p0 = pl->start[pl->used[u0]];
    #pragma omp for schedule(dynamic, 4)
    for (int t = 0; t < tasks; t++) {
        const int e = pl->used[u0 + t / per], part = t % per / groups, g = t % groups;
        const long bytes = expert_group(parts + part, strides[part], e, g, part * n, ldy, K, pl->start[e] - p0,
                                        pl->start[e + 1] - p0, b, xf, y, m->int8);
        if (reads) {
            #pragma omp atomic
            reads[e] += bytes;
        }
    }
    amx_release();
}

/* One wave for a thread of the region (every thread runs it: its loops end in barriers). */
static void wave_team(const hp_moe *m, const moe_plan *pl, int w, const float *x, moe_buf *b, float *out,
                      int64_t *reads) {
    const int E = m->E, I = m->I, p0 = pl->start[pl->used[pl->wave[w]]];
    const int rows = pl->start[pl->used[pl->wave[w + 1] - 1] + 1] - p0;
    const hp_part gu[2] = {m->gate, m->up}, down[1] = {m->down};
    const int64_t gus[2] = {m->gate_stride, m->up_stride}, ds[1] = {m->down_stride};
    if (m->int8) {
        xquant_rows(x, pl->tok + p0, rows, E, !k_family(m->gate.qtype) || !k_family(m->up.qtype),
                    k_family(m->gate.qtype) || k_family(m->up.qtype), &b->x32, &b->xk);
    } else {
        #pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) memcpy(b->xs + (size_t)r * E, x + (size_t)pl->tok[p0 + r] * E, sizeof(float) * E);
    }
    wave_products(m, pl, w, gu, gus, 2, E, b->xs, b->h, b, reads);
    const int dk = k_family(m->down.qtype);
    #pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        silu_mul_row(b->h + (size_t)r * 2 * I, I, b->act + (size_t)r * I);
        if (m->int8) xquant_row(b->act + (size_t)r * I, I, r, !dk, dk, &b->x32, &b->xk);
    }
    wave_products(m, pl, w, down, ds, 1, I, b->act, b->y, b, reads);
    /* each token's experts in ascending order (its first starts from 0): threads take
     * columns, every slot in order; no barrier after it (the next wave's first loop
     * writes neither out nor y, and ends in one) */
    #pragma omp for schedule(static) nowait
    for (int c = 0; c < E; c += 64) {
        const int c1 = c + 64 < E ? c + 64 : E;
        for (int r = 0; r < rows; r++) {
            float *o = out + (size_t)pl->tok[p0 + r] * E;
            const float *yr = b->y + (size_t)r * E, wt = pl->wt[p0 + r];
            if (pl->first[p0 + r]) for (int j = c; j < c1; j++) o[j] = 0.0f + wt * yr[j];
            else for (int j = c; j < c1; j++) o[j] = o[j] + wt * yr[j];
        }
    }
}

/* out [T, E] = the mixture's FFN of x [T, E] (float32), each token's experts ids [T, k]
 * with router weights w [T, k]; reads (NULL, or [X]): each expert's weight bytes read
 * are added to it. Returns 0; -1 for experts whose types, shapes or strides do not fit;
 * -2 when out of memory; -3 for an expert id outside 0..X-1 (out is then unchanged). */
int hp_moe_ffn(const hp_moe *m, const float *x, int T, const int64_t *ids, const float *w, int k, float *out,
               int64_t *reads, int nthreads) {
    if (!moe_valid(m) || k <= 0 || T < 0) return -1;
    if (T == 0) return 0;
    moe_plan pl = {0};
    int rc = plan_build(&pl, ids, w, T, k, m->X);
    moe_buf b = {0};
    if (!rc && !buf_alloc(&b, m, pl.rows)) rc = -2;
    if (!rc) {
        #pragma omp parallel num_threads(nthreads)
        for (int wv = 0; wv < pl.nwaves; wv++) wave_team(m, &pl, wv, x, &b, out, reads);
    }
    buf_free(&b, m);
    plan_free(&pl);
    return rc;
}
