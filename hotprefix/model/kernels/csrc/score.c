/* Prompt logprobs (scoring): per row of logits, the target token's logprob (its logit less
 * the row's log-sum-exp over the whole vocabulary), its rank, and the row's k most likely
 * tokens. One row is read three times from cache (max, then the sum of exponentials with
 * the count of larger logits, then the top k where asked), instead of torch's separate
 * passes and temporaries. Each row is its own computation in one fixed order (lane i of 16
 * adds the terms v = i mod 16, as dot16 does), so a row's result is the same bits however
 * many rows are scored together and on every build. */
#include <math.h>
#include <string.h>

#include "ops.h"
#include "hp_api.h"

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
            part[i] = part[i] + exp_nonpos(x[v + i] - m);
            cnt[i] += x[v + i] > above;
        }
    }
    for (; v < V; v++) {
        part[v % 16] = part[v % 16] + exp_nonpos(x[v] - m);
        cnt[v % 16] += x[v] > above;
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) part[i] = part[i] + part[i + w];
    int64_t c = 0;
    for (int i = 0; i < 16; i++) c += cnt[i];
    *n_above = c;
    return part[0];
}

/* logits x[v0 .. v1) into the k largest so far (n of them, largest first; ties: the
 * lower token id first); returns the new n */
static int top_insert(const float *x, int v0, int v1, int k, int n, int64_t *ids, float *vals) {
    for (int v = v0; v < v1; v++) {
        if (n == k && !(x[v] > vals[k - 1])) continue;
        int j = n < k ? n++ : k - 1;
        while (j > 0 && x[v] > vals[j - 1]) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        vals[j] = x[v];
        ids[j] = v;
    }
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
