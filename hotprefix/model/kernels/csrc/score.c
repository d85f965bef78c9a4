/* Prompt logprobs (scoring): per row of logits, the target token's logprob (its logit less
 * the row's log-sum-exp over the whole vocabulary), its rank, and the row's k most likely
 * tokens. One row is read three times from cache (max, then the sum of exponentials with
 * the count of larger logits, then the top k where asked), instead of torch's separate
 * passes and temporaries. Each row is its own computation in one fixed order (lane i of 16
 * adds the terms v = i mod 16, as dot16 does), so a row's result is the same bits however
 * many rows are scored together and on every build.
 *
 * hp_score_head scores rows of hidden states on the head's int8 blocks without writing their
 * logits out: segments of SEG_COLS logits (of SEG_ROWS rows: 512 KB, in L2) are made by the
 * head's own group kernels, each row's statistics taken per segment while they are in cache,
 * and the segments combined in order. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "hp_api.h"

/* The loops below are written in 16 lanes; gcc's tuning for recent Xeons would split them in
 * two 256-bit halves. Lane-wise, so the same bits at either width. */
#if defined(__x86_64__)
#pragma GCC target("prefer-vector-width=512")
#endif

/* e^x for x <= 0 (below -87, or NaN: e^-87), exp_nonpos's steps with each multiply-add one fused
 * step: fmaf rounds once on every build (an FMA instruction, else the C library's), so the
 * same bits everywhere, in ~16 vector operations where exp_nonpos takes ~25 (the scoring
 * sums are most of a score's time after the head's product). */
static inline float exp_fma(float x) {
    x = !(x >= -87.0f) ? -87.0f : x;  /* NaN too: its integer conversion below would be undefined */
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = fmaf(-n, 1.428606765330187e-06f, fmaf(-n, 0.693145751953125f, x));
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale2n;
    memcpy(&scale2n, &bits, 4);
    return p * scale2n;
}

/* max over the row: exact in any order */
static float row_max(const float *x, int V) {
    float m = -INFINITY;
    #pragma omp simd reduction(max : m)
    for (int v = 0; v < V; v++) m = x[v] > m ? x[v] : m;
    return m;
}

/* sum of e^(x - m) in 16 fixed lanes, and how many logits are above `above` */
static float row_sum_exp(const float *x, int V, float m, float above, int64_t *n_above) {
    float part[16] = {0};
    int cnt[16] = {0};
    int v = 0;
    for (; v + 16 <= V; v += 16) {
        #pragma omp simd
        for (int i = 0; i < 16; i++) {
            part[i] = part[i] + exp_fma(x[v + i] - m);
            cnt[i] += x[v + i] > above;
        }
    }
    for (; v < V; v++) {
        part[v % 16] = part[v % 16] + exp_fma(x[v] - m);
        cnt[v % 16] += x[v] > above;
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) part[i] = part[i] + part[i + w];
    int64_t c = 0;
    for (int i = 0; i < 16; i++) c += cnt[i];
    *n_above = c;
    return part[0];
}

/* (x, id) into the k largest so far (n of them, largest first; an equal value after those
 * held: callers bring equal values in ascending id order, so ties keep the lower id first);
 * the new n */
static int top_add(float x, int64_t id, int k, int n, int64_t *ids, float *vals) {
    if (n == k && !(x > vals[k - 1])) return n;
    int j = n < k ? n++ : k - 1;
    while (j > 0 && x > vals[j - 1]) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        j--;
    }
    vals[j] = x;
    ids[j] = id;
    return n;
}

/* logits x[v0 .. v1) into the k largest so far (top_add, token v's id v); returns the new n */
static int top_insert(const float *x, int v0, int v1, int k, int n, int64_t *ids, float *vals) {
    for (int v = v0; v < v1; v++) n = top_add(x[v], v, k, n, ids, vals);
    return n;
}

/* the k largest logits, largest first (ties: the lower token id first). Once k are
 * held, a run of 64 logits none above the k-th (an exact vector max) is passed over:
 * top_insert would take none of them either, so the result is the same. */
static void row_top(const float *x, int V, int k, int64_t *ids, float *vals) {
    int n = top_insert(x, 0, k < V ? k : V, k, 0, ids, vals), v = n;
    for (; v + 64 <= V; v += 64) {
        float m = -INFINITY;
        #pragma omp simd reduction(max : m)
        for (int i = 0; i < 64; i++) m = x[v + i] > m ? x[v + i] : m;
        if (m > vals[k - 1]) n = top_insert(x, v, v + 64, k, n, ids, vals);
    }
    top_insert(x, v, V, k, n, ids, vals);
}

void hp_score_rows(const float *logits, int R, int V, const int64_t *targets, int k, float *lp, int64_t *rank,
                   int64_t *top_ids, float *top_lp, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (R > 1)
    for (int r = 0; r < R; r++) {
        const float *x = logits + (size_t)r * V;
        const float t = x[targets[r]], m = row_max(x, V);
        int64_t above;
        const float lse = m + logf(row_sum_exp(x, V, m, t, &above));
        lp[r] = t - lse;
        rank[r] = above + 1;
        if (k > 0) {
            row_top(x, V, k, top_ids + (size_t)r * k, top_lp + (size_t)r * k);
            for (int j = 0; j < k; j++) top_lp[(size_t)r * k + j] -= lse;
        }
    }
}

/* Scoring on the head's blocks: the logits of rows r0..r1 and of a segment's columns
 * (SEG_COLS of them, 64 groups) are made into a buffer that stays in L2, and each row's
 * statistics over the segment taken from there. Threads take whole segments; a segment's
 * weights (~600 KB at K = 576) stay in cache while every row passes. */
#define SEG_COLS 1024
#define SEG_ROWS 128

typedef struct {
    float m, s;     /* the segment's largest logit; the sum of e^(x - m) over it (16 lanes) */
    int64_t above;  /* its logits above the row's target logit */
    int ntop;       /* entries of its top list (min(k, its columns)) */
} seg_stat;

/* one row's statistics over a segment's `cols` logits y (the segment's first token id0) */
static void seg_row(const float *y, int cols, float t, int k, int64_t id0, seg_stat *st, int64_t *ids,
                    float *vals) {
    st->m = row_max(y, cols);
    if (st->m == -INFINITY) {  /* nothing above -inf: no mass, nothing above the target */
        st->s = 0.0f;
        st->above = 0;
    } else {
        st->s = row_sum_exp(y, cols, st->m, t, &st->above);
    }
    st->ntop = 0;
    if (k == 1) {  /* row_top's answer from the max: its first occurrence */
        const float m = st->m;
        int v = 0;
        for (; v + 16 <= cols; v += 16) {  /* to its run of 16, a vector compare a run */
            int hit = 0;
            #pragma omp simd reduction(| : hit)
            for (int i = 0; i < 16; i++) hit |= y[v + i] == m;
            if (hit) break;
        }
        while (v < cols && !(y[v] == m)) v++;
        if (v == cols) v = 0;  /* no logit equals the max (all NaN): row_top's first entry */
        ids[0] = id0 + v;
        vals[0] = y[v];
        st->ntop = 1;
    } else if (k > 0) {
        row_top(y, cols, k, ids, vals);
        st->ntop = k < cols ? k : cols;
        for (int j = 0; j < st->ntop; j++) ids[j] += id0;
    }
}

/* a row's result from its nseg segments, combined in order: the log-sum-exp
 * max + log(sum of s e^(m_seg - max)), the logits above the target, the k largest */
static void merge_row(const seg_stat *st, int nseg, const int64_t *ids, const float *vals, int k, float t,
                      float *lp, int64_t *rank, int64_t *top_ids, float *top_lp) {
    float m = -INFINITY, sum = 0.0f;
    int64_t above = 0;
    for (int s = 0; s < nseg; s++) m = st[s].m > m ? st[s].m : m;
    for (int s = 0; s < nseg; s++) {
        if (st[s].m > -INFINITY) sum = sum + st[s].s * exp_fma(st[s].m - m);
        above += st[s].above;
    }
    const float lse = m + logf(sum);
    *lp = t - lse;
    *rank = above + 1;
    int n = 0;
    for (int s = 0; s < nseg; s++)
        for (int j = 0; j < st[s].ntop; j++)
            n = top_add(vals[(size_t)s * k + j], ids[(size_t)s * k + j], k, n, top_ids, top_lp);
    for (int j = 0; j < k; j++) top_lp[j] -= lse;
}

/* hp_score_head's work: its head, rows and per-row, per-segment state. */
typedef struct {
    const hp_part *part;
    int M, K, k, nseg;
    const int64_t *targets;  /* [M] */
    xquant x32, xk;          /* x quantized for the head's block family */
    float *chosen;           /* [M] the targets' logits */
    seg_stat *st;            /* [M, nseg] */
    int64_t *sids;           /* [M, nseg, k] each segment's top ids, */
    float *svals;            /* and logits */
} score_job;

static int job_alloc(score_job *j) {
    const size_t cells = (size_t)j->M * j->nseg, tops = cells * (size_t)(j->k > 0 ? j->k : 1);
    const int okx = xquant_alloc(&j->x32, j->M, j->K) & xquant_alloc(&j->xk, j->M, j->K);
    j->st = malloc(cells * sizeof *j->st);
    j->sids = malloc(tops * sizeof *j->sids);
    j->svals = malloc(tops * sizeof *j->svals);
    j->chosen = malloc((size_t)j->M * sizeof *j->chosen);
    return okx && j->st && j->sids && j->svals && j->chosen;
}

static void job_free(score_job *j) {
    xquant_free(&j->x32);
    xquant_free(&j->xk);
    free(j->st);
    free(j->sids);
    free(j->svals);
    free(j->chosen);
}

/* Segment s for every row: the head's logits (its group kernels: the same bits as
 * hp_qmatmul_i8's) into buf, SEG_ROWS rows at a time, then each row's statistics. */
static void score_segment(const score_job *j, int s, float *buf) {
    const int c0 = s * SEG_COLS, cols = j->part->n - c0 < SEG_COLS ? j->part->n - c0 : SEG_COLS;
    const int g0 = c0 / G, ng = (cols + G - 1) / G, k = j->k;
    for (int r0 = 0; r0 < j->M; r0 += SEG_ROWS) {
        const int r1 = j->M - r0 < SEG_ROWS ? j->M : r0 + SEG_ROWS;
        for (int g = 0; g < ng; g++)
            i8_group_rows(j->part, g0 + g, SEG_COLS, j->K, r0, r1, &j->x32, &j->xk, buf + (size_t)g * G);
        for (int r = r0; r < r1; r++) {
            const size_t at = (size_t)r * j->nseg + s;
            seg_row(buf + (size_t)(r - r0) * SEG_COLS, cols, j->chosen[r], k, c0, j->st + at, j->sids + at * k,
                    j->svals + at * k);
        }
    }
}

/* A thread's part of hp_score_head (every thread of the region calls it; its loops end in
 * barriers): x quantized, the targets' logits (a row's own group product, VNNI), then whole
 * segments. *fail set where a thread's buffer could not be had. */
static void score_team(score_job *j, const float *x, int *fail) {
    float *buf = aligned_alloc(64, (size_t)SEG_ROWS * SEG_COLS * sizeof(float));
    float one[G] __attribute__((aligned(64)));
    const int need32 = !k_family(j->part->qtype);
    xquant_rows(x, NULL, j->M, j->K, need32, !need32, &j->x32, &j->xk);
    #pragma omp for schedule(static)
    for (int m = 0; m < j->M; m++) {
        i8_group_rows(j->part, (int)(j->targets[m] / G), G, j->K, m, m + 1, &j->x32, &j->xk, one);
        j->chosen[m] = one[j->targets[m] % G];
    }
    #pragma omp for schedule(static)
    for (int s = 0; s < j->nseg; s++) {
        if (!buf) {
            #pragma omp atomic write
            *fail = 1;
            continue;
        }
        score_segment(j, s, buf);
    }
    amx_release();
    free(buf);
}

/* Per row of x [M, K] (hidden states, float32): its logits on the head `part` (one int8 part of
 * the regrouped layout, V = part->n rows) scored as hp_score_rows scores them (the target's
 * logprob and rank, the k largest logits' ids and logprobs), without the [M, V] logits. The
 * target's logit is its group's product for the row alone (the VNNI kernels: the same bits as
 * a tile's, issue 40). Each row's result is the same bits whatever M and the threads. Returns 0;
 * -1 for an invalid part, k or target; -2 when out of memory. */
int hp_score_head(const hp_part *part, const float *x, int M, int K, const int64_t *targets, int k, float *lp,
                  int64_t *rank, int64_t *top_ids, float *top_lp, int nthreads) {
    if (!parts_valid(part, 1, K) || k < 0 || k > part->n) return -1;
    for (int m = 0; m < M; m++)
        if (targets[m] < 0 || targets[m] >= part->n) return -1;
    if (M <= 0) return 0;
    score_job j = {.part = part, .M = M, .K = K, .k = k, .nseg = (part->n + SEG_COLS - 1) / SEG_COLS,
                   .targets = targets};
    int fail = !job_alloc(&j);
    if (!fail) {
        #pragma omp parallel num_threads(nthreads)
        {
            score_team(&j, x, &fail);
            if (!fail) {
                #pragma omp for schedule(static)
                for (int m = 0; m < M; m++) {
                    const size_t at = (size_t)m * j.nseg;
                    merge_row(j.st + at, j.nseg, j.sids + at * k, j.svals + at * k, k, j.chosen[m], lp + m,
                              rank + m, top_ids + (size_t)m * k, top_lp + (size_t)m * k);
                }
            }
        }
    }
    job_free(&j);
    return fail ? -2 : 0;
}
