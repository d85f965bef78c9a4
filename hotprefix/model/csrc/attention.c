/* ------------------------------------------------------------------------
 * Decode attention straight from the paged KV cache (float32).
 *
 * k, v: [KVH, S, D] (head-major slots, kv_cache.py). A task attends nrows query
 * rows (D floats each, at q + rows[i] * D) to the keys of one KV head at the
 * listed slots, with an online softmax over chunks of keys: each key and value
 * is read once per task, from the pool, instead of being gathered first.
 * Writes out[rows[i]] ([D]) and lse[rows[i]] (log-sum-exp of the scaled scores,
 * for merging with attention over other keys).
 * task: [ntasks, 5] = (row offset into rows, nrows, slot offset into slots, nslots, kv head).
 * Returns 0, or -2 when out of memory.
 * ------------------------------------------------------------------------ */
#include "ops.h"
#include "hp_api.h"

#define ATT_CHUNK 32

/* Per-thread scratch of the attention tasks: rows of up to maxr queries of D floats. */
int att_scratch_alloc(att_scratch *a, int maxr, int D) {
    a->acc = malloc(sizeof(float) * (size_t)maxr * D);
    a->s = malloc(sizeof(float) * (size_t)maxr * ATT_CHUNK);
    a->kt = malloc(sizeof(float) * (size_t)D * ATT_CHUNK);  /* a chunk of keys, transposed [D, CHUNK] */
    a->mx = malloc(sizeof(float) * maxr);
    a->l = malloc(sizeof(float) * maxr);
    return a->acc && a->s && a->kt && a->mx && a->l;
}

void att_scratch_free(att_scratch *a) { free(a->acc); free(a->s); free(a->kt); free(a->mx); free(a->l); }

/* One attention task (see hp_paged_attention): tk = (row offset, nrows, slot offset, nslots, kv head). */
void attend_task(const float *q, const int64_t *rows, const int64_t *tk, const float *k, const float *v,
                 int64_t head_stride, int D, const int64_t *slots, float scale, float *out, float *lse,
                 const att_scratch *scr) {
    float *acc = scr->acc, *s = scr->s, *kt = scr->kt, *mx = scr->mx, *l = scr->l;
    const int64_t *rw = rows + tk[0], *sl = slots + tk[2];
    const int R = (int)tk[1], n = (int)tk[3];
    const float *kh = k + tk[4] * head_stride, *vh = v + tk[4] * head_stride;
    for (int r = 0; r < R; r++) {
        mx[r] = -INFINITY; l[r] = 0.0f;
        for (int d = 0; d < D; d++) acc[(size_t)r * D + d] = 0.0f;
    }
    for (int j0 = 0; j0 < n; j0 += ATT_CHUNK) {
        const int c = n - j0 < ATT_CHUNK ? n - j0 : ATT_CHUNK;
        int direct = 0;  /* few rows: dot products on the keys as stored, no transposition */
#if defined(HP_F512)
        if (R <= 4 && D % 16 == 0) {
            direct = 1;
            for (int j = 0; j < c; j++) {
                const float *kj = kh + sl[j0 + j] * D;
                for (int r = 0; r < R; r++) {
                    const float *qr = q + rw[r] * D;
                    __m512 a = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 16)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kj + d), a);
                    s[(size_t)r * ATT_CHUNK + j] = _mm512_reduce_add_ps(a);
                }
            }
        }
#endif
        if (!direct) {
            for (int j = 0; j < ATT_CHUNK; j++) {  /* keys as columns: scores need no horizontal sums */
                const float *kj = kh + sl[j0 + (j < c ? j : 0)] * D;
                for (int d = 0; d < D; d++) kt[(size_t)d * ATT_CHUNK + j] = j < c ? kj[d] : 0.0f;
            }
            for (int r = 0; r < R; r++) {
                const float *qr = q + rw[r] * D;
                float *sr = s + (size_t)r * ATT_CHUNK;
#if defined(VF_W)
                vf sv[ATT_CHUNK / VF_W];  /* the chunk's scores stay in registers over D */
                for (int u = 0; u < ATT_CHUNK / VF_W; u++) sv[u] = vf_zero();
                for (int d = 0; d < D; d++) {
                    const vf qd = vf_set1(qr[d]);
                    const float *kd = kt + (size_t)d * ATT_CHUNK;
                    for (int u = 0; u < ATT_CHUNK / VF_W; u++) sv[u] = vf_fma(qd, vf_load(kd + u * VF_W), sv[u]);
                }
                for (int u = 0; u < ATT_CHUNK / VF_W; u++) vf_store(sr + u * VF_W, sv[u]);
#else
                for (int j = 0; j < ATT_CHUNK; j++) sr[j] = 0.0f;
                for (int d = 0; d < D; d++) {
                    const float qd = qr[d];
                    const float *kd = kt + (size_t)d * ATT_CHUNK;
                    #pragma omp simd
                    for (int j = 0; j < ATT_CHUNK; j++) sr[j] = fmaf(qd, kd[j], sr[j]);
                }
#endif
            }
        }
        for (int r = 0; r < R; r++) {  /* online softmax: rescale what came before */
            float *sr = s + (size_t)r * ATT_CHUNK;
            float m = mx[r];
            for (int j = 0; j < c; j++) { sr[j] *= scale; m = sr[j] > m ? sr[j] : m; }
            const float corr = expf(mx[r] - m);  /* 0 on the first chunk (exp(-inf)) */
            float sum = 0.0f;
            #pragma omp simd reduction(+:sum)
            for (int j = 0; j < c; j++) { sr[j] = exp_nonpos(sr[j] - m); sum += sr[j]; }
            l[r] = l[r] * corr + sum;
            mx[r] = m;
            float *ar = acc + (size_t)r * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ar[d] *= corr;
        }
#if defined(VF_W)
        if (D % (4 * VF_W) == 0) {  /* 4 vectors of a row's output columns stay in registers over the chunk */
            for (int d0 = 0; d0 < D; d0 += 4 * VF_W)
                for (int r = 0; r < R; r++) {
                    float *ar = acc + (size_t)r * D + d0;
                    const float *pr = s + (size_t)r * ATT_CHUNK;
                    vf a[4];
                    for (int u = 0; u < 4; u++) a[u] = vf_load(ar + u * VF_W);
                    for (int j = 0; j < c; j++) {
                        const float *vj = vh + sl[j0 + j] * D + d0;
                        const vf p = vf_set1(pr[j]);
                        for (int u = 0; u < 4; u++) a[u] = vf_fma(p, vf_load(vj + u * VF_W), a[u]);
                    }
                    for (int u = 0; u < 4; u++) vf_store(ar + u * VF_W, a[u]);
                }
            continue;
        }
#endif
        for (int j = 0; j < c; j++) {  /* each value row once, for every query row */
            const float *vj = vh + sl[j0 + j] * D;
            for (int r = 0; r < R; r++) {
                const float p = s[(size_t)r * ATT_CHUNK + j];
                float *ar = acc + (size_t)r * D;
                #pragma omp simd
                for (int d = 0; d < D; d++) ar[d] = fmaf(p, vj[d], ar[d]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float *o = out + rw[r] * D;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) o[d] = acc[(size_t)r * D + d] * inv;
        lse[rw[r]] = mx[r] + logf(l[r]);
    }
}

int max_task_rows(const int64_t *task, int ntasks) {
    int maxr = 1;
    for (int t = 0; t < ntasks; t++) maxr = task[5 * t + 1] > maxr ? (int)task[5 * t + 1] : maxr;
    return maxr;
}

int hp_paged_attention(const float *q, const int64_t *rows, const int64_t *task, int ntasks,
                       const float *k, const float *v, int64_t head_stride, int D, const int64_t *slots,
                       float scale, float *out, float *lse, int nthreads) {
    const int maxr = max_task_rows(task, ntasks);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:failed)
    {
        att_scratch scr;
        if (!att_scratch_alloc(&scr, maxr, D)) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < ntasks; t++) {
            if (failed) continue;
            attend_task(q, rows, task + 5 * t, k, v, head_stride, D, slots, scale, out, lse, &scr);
        }
        att_scratch_free(&scr);
    }
    return failed ? -2 : 0;
}
