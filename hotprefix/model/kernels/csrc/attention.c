/* ------------------------------------------------------------------------
 * Attention read in place from the paged float32 pool, the same bits for a query
 * whatever else its step holds.
 *
 * k, v: [KVH, S, D] (head-major slots, kv_cache.py). A plan (hp_plan) lists tasks; a
 * task attends some query rows (D floats each, at q + rows[i] * D) to the keys of one KV
 * head at positions [lo_i, hi_i) of each row (lims), reading position p from slot
 * slots[slot0 + p - base]. Prefill chunks, decodes and cascades are all such tasks.
 *
 * Batch invariance: a row's result depends only on its query, its keys and values and
 * its range, never on the other rows of its task or step. Keys are taken in tiles of
 * TILE aligned to absolute positions (tile t holds positions [t TILE, (t + 1) TILE));
 * within a tile each score is one fused multiply-add chain over d = 0..D-1 times the
 * scale, the tile's weights are exp_nonpos(s - m) per key (ops.h: the same arithmetic
 * in every build), summed key by key in position order, and the output accumulates
 * p_j v_j key by key (one fused multiply-add per value): an online softmax whose state
 * (running max m, sum l, accumulator acc) is rescaled by exp_nonpos(m_old - m_new) once
 * per tile. Nothing is reduced across vector lanes, so the AVX-512, AVX2 and plain C
 * builds give the same bits. A task with ATT_INIT starts from a state saved by an
 * earlier pass (a cascade's shared prefix, whose length is a multiple of TILE), so a
 * prefix attended once for a group and then each member's own keys is the same
 * arithmetic as one pass; without ATT_FINAL the state is saved instead of the output.
 * ------------------------------------------------------------------------ */
#include "ops.h"
#include "hp_api.h"
#include "att_tile.h"

#if defined(HP_F512)
#define RB 8  /* query rows a pass over a tile's transposed keys takes at once (their scores in registers) */
#define RV 4  /* query rows a pass over a tile's value rows takes at once (4 vectors of each's sums in registers) */
#else
#define RB 4
#define RV 2
#endif

enum { T_ROW0, T_NROWS, T_SLOT0, T_BASE, T_HEAD, T_FLAGS, T_FIELDS };

/* Per-thread scratch of the attention tasks: state of up to maxr rows of D floats; with
 * an fp8 pool, a value row and the 256 values of a byte for K and V (times their scales). */
int att_scratch_alloc(att_scratch *a, int maxr, int D) {
    a->acc = malloc(sizeof(float) * (size_t)maxr * D);
    a->s = malloc(sizeof(float) * (size_t)maxr * HP_TILE);
    a->kt = malloc(sizeof(float) * (size_t)D * HP_TILE);  /* a tile of keys, transposed [D, TILE] */
    a->mx = malloc(sizeof(float) * maxr);
    a->l = malloc(sizeof(float) * maxr);
    a->vrow = malloc(sizeof(float) * (size_t)D * HP_TILE);  /* fp8: a tile's value rows, dequantized */
    a->lut = malloc(sizeof(float) * 512);
    return a->acc && a->s && a->kt && a->mx && a->l && a->vrow && a->lut;
}

void att_scratch_free(att_scratch *a) {
    free(a->acc); free(a->s); free(a->kt); free(a->mx); free(a->l); free(a->vrow); free(a->lut);
}

/* The lookup tables of an fp8 pass: lut[b] = value(b) * k_scale, lut[256 + b] = value(b) * v_scale
 * (the float32 product torch's dequantization makes). */
void att_scratch_fp8(const att_scratch *a, const hp_att *att) {
    if (att->kv_type == KV_F32) return;
    for (int b = 0; b < 256; b++) {
        const float x = fp8_value((uint8_t)b, att->kv_type);
        a->lut[b] = x * att->k_scale;
        a->lut[256 + b] = x * att->v_scale;
    }
}

int max_task_rows(const hp_plan *p) {
    int maxr = 1;
    for (int t = 0; t < p->ntasks; t++) {
        const int64_t n = p->task[T_FIELDS * t + T_NROWS];
        maxr = n > maxr ? (int)n : maxr;
    }
    return maxr;
}

/* Scores of rows r0 .. r0 + n - 1 (n <= RB) against the tile kt [D, TILE]: s[r] = q_r . k_j
 * for every lane j, one fused multiply-add chain over d (lanes never mix). Inlined for each
 * constant n (tile_scores): the rows' accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_scores_n(const float *q, const int64_t *rw, int r0, const int n,
                                                                const float *kt, int D, float *s) {
#if defined(VF_W)
    vf acc[RB][HP_TILE / VF_W];
    for (int r = 0; r < n; r++)
        for (int u = 0; u < HP_TILE / VF_W; u++) acc[r][u] = vf_zero();
    for (int d = 0; d < D; d++) {
        vf kd[HP_TILE / VF_W];
        for (int u = 0; u < HP_TILE / VF_W; u++) kd[u] = vf_load(kt + (size_t)d * HP_TILE + u * VF_W);
        for (int r = 0; r < n; r++) {
            const vf qd = vf_set1(q[rw[r0 + r] * D + d]);
            for (int u = 0; u < HP_TILE / VF_W; u++) acc[r][u] = vf_fma(qd, kd[u], acc[r][u]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int u = 0; u < HP_TILE / VF_W; u++) vf_store(s + (size_t)(r0 + r) * HP_TILE + u * VF_W, acc[r][u]);
#else
    for (int r = 0; r < n; r++) {
        float *sr = s + (size_t)(r0 + r) * HP_TILE;
        const float *qr = q + rw[r0 + r] * D;
        for (int j = 0; j < HP_TILE; j++) sr[j] = 0.0f;
        for (int d = 0; d < D; d++)
            for (int j = 0; j < HP_TILE; j++) sr[j] = fmaf(qr[d], kt[(size_t)d * HP_TILE + j], sr[j]);
    }
#endif
}

static void tile_scores(const float *q, const int64_t *rw, int r0, int n, const float *kt, int D, float *s) {
    switch (n) {
#define TS(k) case k: tile_scores_n(q, rw, r0, k, kt, D, s); break;
        TS(1) TS(2) TS(3) TS(4)
#if RB > 4
        TS(5) TS(6) TS(7) TS(8)
#endif
#undef TS
        default: tile_scores_n(q, rw, r0, n, kt, D, s);
    }
}

/* The tile's weights of its R rows (row r's keys: lanes [jlo_r, jhi_r); a row with none is
 * left alone): scales each row's scores, turns them into exp_nonpos(s - m_new) in place (0 on
 * other lanes), and rescales its state. Every lane is computed alike (fixed trip counts: the
 * loops vectorize); the max is exact in any order; the sum is a fixed tree over the 16 lanes.
 * In three passes over the rows (new maxima, weights, state), so that the rows' exponentials,
 * which do not depend on each other, are in flight together: each row's operations are
 * those of one row alone, in its order. */
static void tile_softmax(float *s, const int *jlo, const int *jhi, int R, float scale, float *mx, float *l,
                         float *acc, int D) {
    float m_new[HP_MAX_TASK_ROWS];
    for (int r = 0; r < R; r++) {
        if (jhi[r] <= jlo[r]) continue;
        float *sr = s + (size_t)r * HP_TILE, t[HP_TILE];
        #pragma omp simd
        for (int j = 0; j < HP_TILE; j++) {
            sr[j] *= scale;
            t[j] = j >= jlo[r] && j < jhi[r] ? sr[j] : -INFINITY;
        }
        const float tmax = tree16_max(t);
        m_new[r] = tmax > mx[r] ? tmax : mx[r];
    }
    for (int r = 0; r < R; r++) {
        if (jhi[r] <= jlo[r]) continue;
        float *sr = s + (size_t)r * HP_TILE;
        const float m = m_new[r];
        const int lo = jlo[r], hi = jhi[r];
        #pragma omp simd
        for (int j = 0; j < HP_TILE; j++) {
            const float e = exp_nonpos(sr[j] - m);
            sr[j] = j >= lo && j < hi ? e : 0.0f;
        }
    }
    for (int r = 0; r < R; r++) {
        if (jhi[r] <= jlo[r]) continue;
        /* the running max unchanged and finite: corr = exp_nonpos(0) = 1 exactly, and l * 1 and
         * acc * 1 are l and acc, so the rescale is skipped (most tiles: the same bits, less work) */
        const int same = m_new[r] == mx[r] && isfinite(m_new[r]);
        const float corr = same ? 1.0f : exp_nonpos(mx[r] - m_new[r]);  /* the first tile: acc and l are 0 */
        float t[HP_TILE];  /* (the plain C trees work in place) */
        memcpy(t, s + (size_t)r * HP_TILE, sizeof t);
        l[r] = l[r] * corr + tree16_sum(t);
        mx[r] = m_new[r];
        if (same) continue;
        float *ar = acc + (size_t)r * D;
        #pragma omp simd
        for (int d = 0; d < D; d++) ar[d] *= corr;
    }
}

/* The tile's value rows: pointers to float32 rows of the pool, or fp8 rows dequantized
 * (through lut) into vt [TILE, D]; only lanes [lo, hi) are read. */
static void tile_value_rows(const void *vh, int kv_type, const float *lut, float *vt, const int64_t *sl, int j0,
                            int lo, int hi, int D, const float **rows) {
    for (int j = lo; j < hi; j++) {
        if (kv_type == KV_F32) {
            rows[j] = (const float *)vh + sl[j0 + j] * D;
            continue;
        }
        const uint8_t *vb = (const uint8_t *)vh + sl[j0 + j] * D;
        float *dst = vt + (size_t)j * D;
        for (int d = 0; d < D; d++) dst[d] = lut[vb[d]];
        rows[j] = dst;
    }
}

/* acc[d] += p_j v_j[d] for the keys j in [jlo, jhi), one fused multiply-add a value, j in
 * order, for n rows (p and acc RV-strided: HP_TILE and D floats a row) that take the same
 * keys: each value row loaded once for the n rows, and 4 n independent chains of vectors in
 * registers (one row's 4 chains wait on the FMA latency). Each row's sums are the one-row
 * sums: the same operations in the same order. Inlined for each constant n (row_values). */
static inline __attribute__((always_inline)) void row_values_n(const float *const *rows, int jlo, int jhi,
                                                               const float *p, float *acc, int D, const int n) {
#if defined(VF_W)
    if (D % VF_W == 0) {
        int d0 = 0;
        for (; d0 + 4 * VF_W <= D; d0 += 4 * VF_W) {
            vf a[RV][4];
            for (int r = 0; r < n; r++)
                for (int u = 0; u < 4; u++) a[r][u] = vf_load(acc + (size_t)r * D + d0 + u * VF_W);
            for (int j = jlo; j < jhi; j++) {
                const float *vj = rows[j] + d0;
                vf v[4];
                for (int u = 0; u < 4; u++) v[u] = vf_load(vj + u * VF_W);
                for (int r = 0; r < n; r++) {
                    const vf pj = vf_set1(p[(size_t)r * HP_TILE + j]);
                    for (int u = 0; u < 4; u++) a[r][u] = vf_fma(pj, v[u], a[r][u]);
                }
            }
            for (int r = 0; r < n; r++)
                for (int u = 0; u < 4; u++) vf_store(acc + (size_t)r * D + d0 + u * VF_W, a[r][u]);
        }
        for (; d0 < D; d0 += VF_W)
            for (int r = 0; r < n; r++) {
                vf a = vf_load(acc + (size_t)r * D + d0);
                for (int j = jlo; j < jhi; j++) a = vf_fma(vf_set1(p[(size_t)r * HP_TILE + j]), vf_load(rows[j] + d0), a);
                vf_store(acc + (size_t)r * D + d0, a);
            }
        return;
    }
#endif
    for (int r = 0; r < n; r++)
        for (int j = jlo; j < jhi; j++) {
            const float pj = p[(size_t)r * HP_TILE + j], *vj = rows[j];
            float *ar = acc + (size_t)r * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ar[d] = fmaf(pj, vj[d], ar[d]);
        }
}

static void row_values(const float *const *rows, int jlo, int jhi, const float *p, float *acc, int D, int n) {
    switch (n) {
#define RVN(k) case k: row_values_n(rows, jlo, jhi, p, acc, D, k); break;
        RVN(1) RVN(2)
#if RV > 2
        RVN(3) RVN(4)
#endif
#undef RVN
        default: row_values_n(rows, jlo, jhi, p, acc, D, n);
    }
}

/* acc[r] += p_rj v_j for the keys j of each row r of the tile (lanes [jlo_r, jhi_r)): runs of
 * up to RV consecutive rows with the same lanes together. */
static void tile_values(const void *vh, int kv_type, const float *lut, float *vt, const int64_t *sl, int j0,
                        const int *jlo, const int *jhi, int R, const float *s, float *acc, int D) {
    int lo = HP_TILE, hi = 0;
    for (int r = 0; r < R; r++) {
        if (jhi[r] <= jlo[r]) continue;  /* no keys here (jlo may lie past the tile) */
        lo = jlo[r] < lo ? jlo[r] : lo;
        hi = jhi[r] > hi ? jhi[r] : hi;
    }
    const float *rows[HP_TILE];
    tile_value_rows(vh, kv_type, lut, vt, sl, j0, lo, hi, D, rows);
    for (int r = 0, n; r < R; r += n) {
        for (n = 1; n < RV && r + n < R && jlo[r + n] == jlo[r] && jhi[r + n] == jhi[r]; n++) {}
        if (jhi[r] > jlo[r])
            row_values(rows, jlo[r], jhi[r], s + (size_t)r * HP_TILE, acc + (size_t)r * D, D, n);
    }
}

/* The task's rows start from zero or (ATT_INIT) from their saved state. */
static void task_begin(const hp_att *a, const int64_t *rw, int R, int flags, const att_scratch *scr) {
    for (int r = 0; r < R; r++) {
        float *ar = scr->acc + (size_t)r * a->D;
        if (flags & ATT_INIT) {
            scr->mx[r] = a->st_m[rw[r]];
            scr->l[r] = a->st_l[rw[r]];
            memcpy(ar, a->st_acc + rw[r] * a->D, sizeof(float) * a->D);
        } else {
            scr->mx[r] = -INFINITY;
            scr->l[r] = 0.0f;
            for (int d = 0; d < a->D; d++) ar[d] = 0.0f;
        }
    }
}

/* Each row's output acc / l (ATT_FINAL), or its state saved for a later pass. */
static void task_end(const hp_att *a, const int64_t *rw, int R, int flags, const att_scratch *scr) {
    const int D = a->D;
    for (int r = 0; r < R; r++) {
        const float *ar = scr->acc + (size_t)r * D;
        if (flags & ATT_FINAL) {
            float *o = a->out + rw[r] * D;
            for (int d = 0; d < D; d++) o[d] = ar[d] / scr->l[r];
        } else {
            a->st_m[rw[r]] = scr->mx[r];
            a->st_l[rw[r]] = scr->l[r];
            memcpy(a->st_acc + rw[r] * D, ar, sizeof(float) * D);
        }
    }
}

/* The keys of one tile that any row of the task takes, transposed into kt [D, TILE]
 * (lanes no row takes: 0); fp8 keys through lut (their values times the scale). */
static void tile_keys(const void *kh, int kv_type, const float *lut, const int64_t *sl, int p0, int64_t lo,
                      int64_t hi, int D, float *kt) {
#if defined(KT_W)
    static const float zeros[HP_KT_MAX_D];
    if (kv_type == KV_F32 && D % KT_W == 0 && D <= HP_KT_MAX_D) {
        const float *src[HP_TILE];
        for (int j = 0; j < HP_TILE; j++)
            src[j] = p0 + j < lo || p0 + j >= hi ? zeros : (const float *)kh + sl[p0 + j] * D;
        for (int j0 = 0; j0 < HP_TILE; j0 += KT_W)
            for (int d0 = 0; d0 < D; d0 += KT_W) kt_block(src + j0, d0, kt + j0);
        return;
    }
#endif
    for (int j = 0; j < HP_TILE; j++) {
        const int64_t p = p0 + j;
        if (p < lo || p >= hi) {
            for (int d = 0; d < D; d++) kt[(size_t)d * HP_TILE + j] = 0.0f;
        } else if (kv_type == KV_F32) {
            const float *kj = (const float *)kh + sl[p] * D;
            for (int d = 0; d < D; d++) kt[(size_t)d * HP_TILE + j] = kj[d];
        } else {
            const uint8_t *kj = (const uint8_t *)kh + sl[p] * D;
            for (int d = 0; d < D; d++) kt[(size_t)d * HP_TILE + j] = lut[kj[d]];
        }
    }
}

/* Prefetches the key and value rows of the tile at p0 (positions in [lo, hi)) into the
 * cache while the tile before it is computed: a tile's 16 slots are one 4 KB page of each
 * head's keys and of its values, whose first lines the hardware prefetchers do not fetch
 * ahead. No arithmetic changes. Only for tasks of PREFETCH_ROWS rows or more: a decode's
 * few rows compute too little a tile to pay for its 128 prefetches. */
#define PREFETCH_ROWS 8
static void tile_prefetch(const void *kh, const void *vh, size_t rb, const int64_t *sl, int64_t p0, int64_t lo,
                          int64_t hi) {
    const int64_t a = p0 > lo ? p0 : lo, b = p0 + HP_TILE < hi ? p0 + HP_TILE : hi;
    for (int64_t p = a; p < b; p++) {
        const char *k = (const char *)kh + sl[p] * rb, *v = (const char *)vh + sl[p] * rb;
        for (size_t o = 0; o < rb; o += 64) {
            __builtin_prefetch(k + o, 0, 3);
            __builtin_prefetch(v + o, 0, 3);
        }
    }
}

/* One task of a plan (see the file's comment). */
void attend_task(const hp_att *a, const hp_plan *pl, int t, const att_scratch *scr) {
    const int64_t *tk = pl->task + (size_t)T_FIELDS * t;
    const int64_t *rw = pl->rows + tk[T_ROW0], *lm = pl->lims + 2 * tk[T_ROW0];
    const int R = (int)tk[T_NROWS], D = a->D, flags = (int)tk[T_FLAGS];
    const int64_t *sl = pl->slots + tk[T_SLOT0] - tk[T_BASE];  /* sl[p]: the slot of position p */
    const size_t vb = a->kv_type == KV_F32 ? sizeof(float) : 1;  /* bytes a value */
    const void *kh = (const uint8_t *)a->k + tk[T_HEAD] * a->head_stride * vb;
    const void *vh = (const uint8_t *)a->v + tk[T_HEAD] * a->head_stride * vb;
    int64_t lo = INT64_MAX, hi = 0;
    for (int r = 0; r < R; r++) {
        lo = lm[2 * r] < lo ? lm[2 * r] : lo;
        hi = lm[2 * r + 1] > hi ? lm[2 * r + 1] : hi;
    }
    task_begin(a, rw, R, flags, scr);
    int jlo[HP_MAX_TASK_ROWS], jhi[HP_MAX_TASK_ROWS];
    for (int64_t p0 = lo / HP_TILE * HP_TILE; p0 < hi; p0 += HP_TILE) {
        if (R >= PREFETCH_ROWS) tile_prefetch(kh, vh, (size_t)D * vb, sl, p0 + HP_TILE, lo, hi);
        tile_keys(kh, a->kv_type, scr->lut, sl, (int)p0, lo, hi, D, scr->kt);
        for (int r = 0; r < R; r++) {  /* each row's keys in this tile: lanes [jlo, jhi) */
            const int64_t a0 = lm[2 * r] > p0 ? lm[2 * r] : p0;
            const int64_t a1 = lm[2 * r + 1] < p0 + HP_TILE ? lm[2 * r + 1] : p0 + HP_TILE;
            jlo[r] = (int)(a0 - p0);
            jhi[r] = a1 > a0 ? (int)(a1 - p0) : jlo[r];
        }
        for (int r0 = 0; r0 < R; r0 += RB) tile_scores(a->q, rw, r0, R - r0 < RB ? R - r0 : RB, scr->kt, D, scr->s);
        tile_softmax(scr->s, jlo, jhi, R, a->scale, scr->mx, scr->l, scr->acc, D);
        tile_values(vh, a->kv_type, scr->lut + 256, scr->vrow, sl, (int)p0, jlo, jhi, R, scr->s, scr->acc, D);
    }
    task_end(a, rw, R, flags, scr);
}

/* Checks a plan: every task within HP_MAX_TASK_ROWS rows, a known head, ranges inside its slots. */
int plan_valid(const hp_plan *p, int KVH) {
    for (int t = 0; t < p->ntasks; t++) {
        const int64_t *tk = p->task + (size_t)T_FIELDS * t;
        if (tk[T_NROWS] < 1 || tk[T_NROWS] > HP_MAX_TASK_ROWS || tk[T_HEAD] < 0 || tk[T_HEAD] >= KVH) return 0;
        for (int64_t r = tk[T_ROW0]; r < tk[T_ROW0] + tk[T_NROWS]; r++)
            if (p->lims[2 * r] < tk[T_BASE] || p->lims[2 * r + 1] <= p->lims[2 * r]) return 0;
    }
    return 1;
}

/* Runs every task of `plan` (see the file's comment). Returns 0; -1 for an invalid plan
 * (rows per task, head, ranges); -2 when out of memory. */
int hp_attend(const hp_att *a, const hp_plan *plan, int nthreads) {
    if (!plan_valid(plan, a->KVH) || a->kv_type < KV_F32 || a->kv_type > KV_E5M2) return -1;
    const int maxr = max_task_rows(plan);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        att_scratch scr;
        if (!att_scratch_alloc(&scr, maxr, a->D)) failed = 1;
        else att_scratch_fp8(&scr, a);
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < plan->ntasks; t++) {
            if (failed) continue;
            attend_task(a, plan, t, &scr);
        }
        att_scratch_free(&scr);
    }
    return failed ? -2 : 0;
}
