/* The machine's int8 dot-product peak: 12 independent chains a thread, their accumulators
 * in registers (named variables, not an array the compiler might keep in memory), no
 * memory traffic inside the timed loop. Built by int8_peak.py with the kernel library's
 * flags. Paths, each only where the build's flags have it:
 *   vnni512   vpdpbusd zmm (AVX-512 VNNI)                64 multiply-adds an instruction
 *   vnni256   vpdpbusd ymm, VEX form (AVX-VNNI)          32
 *   avx2      vpmaddubsw + vpmaddwd + vpaddd ymm         32 in 3 instructions (widened to int32 each time)
 *   avx2_i16  vpmaddubsw + vpaddw ymm                    32 in 2 (summed in int16 while it fits; the
 *                                                           kernels widen every 2 to 8 of them)
 *   amx       tdpbusd, AMX tiles 16 x 64 bytes            16384 (4 accumulator tiles, operands in 4 others;
 *                                                          only where the kernel grants the tile data)
 *   amx_k32   tdpbusd with 32-byte A rows                  8192 (the kernels' shape: one 32-value block a product)
 * Usage: int8_peak [seconds a run] [runs] [most threads]. Prints one line a (path,
 * threads): "path threads wall cpu", multiply-adds a second by the wall clock and by the
 * threads' CPU time (rate() says how), each the best of the runs.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define INNER 1000  /* steps of every chain per outer iteration */
#define CHAINS 12
#define EACH(S) S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7) S(8) S(9) S(10) S(11)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static volatile int32_t sink;

/* One kernel: V the vector type, INIT(c) a chain's start, STEP(c) one step of chain c,
 * ADD the lane sum of two vectors, MACS multiply-adds a step, then the declarations of
 * the inputs a, b (and any constant). The inputs are
 * redefined (to the compiler) every outer iteration, so nothing is hoisted. */
#define KERNEL(name, V, INIT, STEP, ADD, MACS, ...)                          \
    static long run_##name(long iters) {                                        \
        __VA_ARGS__                                                             \
        EACH(INIT)                                                              \
        for (long it = 0; it < iters; it++) {                                   \
            __asm__("" : "+v"(a), "+v"(b));                                     \
            for (int i = 0; i < INNER; i++) { EACH(STEP) }                      \
        }                                                                       \
        V s = acc0;                                                             \
        s = ADD(s, acc1); s = ADD(s, acc2); s = ADD(s, acc3);                   \
        s = ADD(s, acc4); s = ADD(s, acc5); s = ADD(s, acc6);                   \
        s = ADD(s, acc7); s = ADD(s, acc8); s = ADD(s, acc9);                   \
        s = ADD(s, acc10); s = ADD(s, acc11);                                   \
        int32_t t[sizeof(V) / 4];                                               \
        memcpy(t, &s, sizeof t);                                                \
        sink = t[0];                                                            \
        return iters * INNER * CHAINS * (long)(MACS);                           \
    }

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define I512(c) __m512i acc##c = _mm512_set1_epi32(c);
#define S512(c) acc##c = _mm512_dpbusd_epi32(acc##c, a, b);
KERNEL(vnni512, __m512i, I512, S512, _mm512_add_epi32, 64,
       __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);)
#endif

#if defined(__AVX2__)
#define I256(c) __m256i acc##c = _mm256_set1_epi32(c);
#endif

#if defined(__AVXVNNI__)
/* inline asm: the VEX encoding, which the compiler may replace by the EVEX one where
 * AVX-512 VL exists; "x": registers 0-15, the VEX form's */
#define SV256(c) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc##c) : "x"(a), "x"(b));
KERNEL(vnni256, __m256i, I256, SV256, _mm256_add_epi32, 32,
       __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);)
#endif

#if defined(__AVX2__)
/* a new `a` to the compiler before each chain's step: one product a chain, none shared */
#define SA2(c) __asm__("" : "+x"(a)); \
    acc##c = _mm256_add_epi32(acc##c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), one));
KERNEL(avx2, __m256i, I256, SA2, _mm256_add_epi32, 32,
       __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), one = _mm256_set1_epi16(1);)
#define SA16(c) __asm__("" : "+x"(a)); acc##c = _mm256_add_epi16(acc##c, _mm256_maddubs_epi16(a, b));
KERNEL(avx2_i16, __m256i, I256, SA16, _mm256_add_epi16, 32,
       __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);)
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>

/* Tiles 0-3: C (16 x 16 int32); 4, 5: A (16 rows of kbytes); 6, 7: B (kbytes / 4 rows of 64). */
static void amx_config(int kbytes) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    for (int t = 4; t < 6; t++) { c.rows[t] = 16; c.colsb[t] = (uint16_t)kbytes; }
    for (int t = 6; t < 8; t++) { c.rows[t] = (uint8_t)(kbytes / 4); c.colsb[t] = 64; }
    __asm__ volatile("ldtilecfg %0" : : "m"(c));  /* gcc 12 drops the stores before _tile_loadconfig */
}

/* 4 independent accumulator tiles, each step 4 tdpbusd of 16 x 16 x kbytes. */
static long run_amx_k(long iters, int kbytes) {
    static uint8_t a[16 * 64] __attribute__((aligned(64)));
    static int8_t b[16 * 64] __attribute__((aligned(64)));
    static int32_t c[16 * 16] __attribute__((aligned(64)));
    memset(a, 3, sizeof a);
    memset(b, -2, sizeof b);
    amx_config(kbytes);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a, 64); _tile_loadd(5, a, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b, 64);
    for (long it = 0; it < iters * INNER; it++) {
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 5, 7); _tile_dpbusd(2, 4, 7); _tile_dpbusd(3, 5, 6);
    }
    _tile_stored(0, c, 64);
    sink = c[0];
    _tile_release();
    return iters * INNER * 4 * 16L * 16 * kbytes;
}

static long run_amx(long iters) { return run_amx_k(iters, 64); }
static long run_amx_k32(long iters) { return run_amx_k(iters, 32); }

/* Whether this process may use the tiles (the kernel grants them on request). */
static int amx_granted(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0; }
#endif

typedef long (*kernel)(long);

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Multiply-adds a second of `k` on `threads` threads at once, the best of `reps` runs of
 * about `seconds` each (sized by an untimed run): by the wall clock (*wall), and summed
 * over the threads by each one's CPU time (*cpu: what the cores do while they run it,
 * whatever else shares them). */
static void rate(kernel k, int threads, double seconds, int reps, double *wall, double *cpu) {
    long iters = 16;
    double t0 = now();
    k(iters);
    double dt = now() - t0;
    iters = (long)(iters * seconds / (dt > 1e-6 ? dt : 1e-6)) + 1;
    *wall = *cpu = 0.0;
    for (int r = 0; r < reps; r++) {
        long macs = 0;
        double per_cpu = 0.0;
        t0 = now();
        #pragma omp parallel num_threads(threads) reduction(+ : macs, per_cpu)
        {
            const double c0 = cpu_now();
            const long n = k(iters);
            macs += n;
            per_cpu += n / (cpu_now() - c0);
        }
        dt = now() - t0;
        if (macs / dt > *wall) *wall = macs / dt;
        if (per_cpu > *cpu) *cpu = per_cpu;
    }
}

int main(int argc, char **argv) {
    const double seconds = argc > 1 ? atof(argv[1]) : 0.3;
    const int reps = argc > 2 ? atoi(argv[2]) : 5, maxthreads = argc > 3 ? atoi(argv[3]) : 2;
    struct { const char *name; kernel k; } paths[] = {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
        {"vnni512", run_vnni512},
#endif
#if defined(__AVXVNNI__)
        {"vnni256", run_vnni256},
#endif
#if defined(__AVX2__)
        {"avx2", run_avx2},
        {"avx2_i16", run_avx2_i16},
#endif
        {NULL, NULL}, {NULL, NULL}, {NULL, NULL}};
    int n = 0;
    while (paths[n].name) n++;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    if (amx_granted()) {
        paths[n].name = "amx"; paths[n++].k = run_amx;
        paths[n].name = "amx_k32"; paths[n++].k = run_amx_k32;
    }
#endif
    for (int p = 0; paths[p].name; p++)
        for (int t = 1; t <= maxthreads; t++) {
            double wall, cpu;
            rate(paths[p].k, t, seconds, reps, &wall, &cpu);
            printf("%s %d %.6e %.6e\n", paths[p].name, t, wall, cpu);
        }
    return 0;
}
