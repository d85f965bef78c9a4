/* RMSNorm, RoPE, silu * up, gelu_tanh * up and KV writes as separate calls (the layer-by-layer path of
 * int8 mode): the row functions of ops.h over the rows, split over OpenMP threads when there
 * is enough work (PAR_MIN values): a few rows (a warm request's new tokens) take
 * microseconds, less than waking the team, and on a machine with more runnable threads
 * than cores a team's barrier waits for a thread's next time slice. Each row is computed
 * the same either way. */
#include "ops.h"
#include "hp_api.h"

#define PAR_MIN ((size_t)1 << 16)

void hp_silu_mul(const float *gu, int M, int I, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if ((size_t)M * I > PAR_MIN)
    for (int m = 0; m < M; m++) silu_mul_row(gu + (size_t)m * 2 * I, I, out + (size_t)m * I);
}

void hp_gelu_tanh_mul(const float *gu, int M, int I, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if ((size_t)M * I > PAR_MIN)
    for (int m = 0; m < M; m++) gelu_tanh_mul_row(gu + (size_t)m * 2 * I, I, out + (size_t)m * I);
}

void hp_kv_write(float *kpool, float *vpool, int64_t head_stride, const int64_t *slots, int T, const float *k,
                 int64_t k_row, const float *v, int64_t v_row, int KVH, int D) {
    for (int t = 0; t < T; t++) kv_write_row(kpool, vpool, head_stride, slots[t], k + t * k_row, v + t * v_row, KVH, D);
}

void hp_kv_write_fp8(uint8_t *kpool, uint8_t *vpool, int64_t head_stride, const int64_t *slots, int T,
                     const float *k, int64_t k_row, const float *v, int64_t v_row, int KVH, int D, int kv_type,
                     float k_scale, float v_scale) {
    for (int t = 0; t < T; t++)
        kv_write_row_fp8(kpool, vpool, head_stride, slots[t], k + t * k_row, v + t * v_row, KVH, D, kv_type, k_scale,
                         v_scale);
}

void hp_rmsnorm(const float *x, int M, int E, int64_t x_row, const float *w, float eps, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if ((size_t)M * E > PAR_MIN)
    for (int m = 0; m < M; m++) rmsnorm_row(x + m * x_row, E, w, eps, out + (size_t)m * E);
}

void hp_rope(float *x, int T, int nh, int64_t x_row, int D, const float *cos_, const float *sin_, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if ((size_t)T * nh * D > PAR_MIN)
    for (int t = 0; t < T; t++) rope_row(x + t * x_row, nh, D, cos_ + (size_t)t * D, sin_ + (size_t)t * D);
}
