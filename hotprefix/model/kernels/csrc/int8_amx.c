/* AMX tiles for the int8 products of many rows of x (prefill): tdpbssd multiplies a tile
 * of 16 rows of x by a block of a group's 16 weight rows, in exact int32 sums, and a
 * vector epilogue applies the block's scales as the VNNI kernels do (int8_q32.c,
 * int8_kq.c): the same integers, the same float steps in the same order, so the same
 * bits (issue 40). Fewer than 16 rows of x go to the VNNI kernels; from 16 on, rows past the
 * last whole tile are a partial tile (its rows past x's are scratch, their sums not stored).
 *
 * Operands: tdpbssd multiplies signed bytes by signed bytes. A is x's int8 rows as
 * quantized (xquant.q); B is a block of the group exactly as repack.c lays it out once its
 * codes are bytes (64-byte rows, byte 4r + t of row i: weight row r, value 4i + t), with
 * the codes' offset taken off where they have one (Q4_0: code - 8; Q6_K: code - 32), so a
 * tile's sums are the VNNI kernels' integers: sum x (code - offset).
 *
 * Used where the CPU has AMX-INT8 and the kernel grants the tile data (arch_prctl, once
 * when the library loads), unless HOTPREFIX_NO_AMX=1 (hp_amx switches it at run time).
 */
#include "hp.h"
#include "hp_api.h"

#if defined(HP_AMX)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted = -1;  /* -1: not asked yet */
static int amx_state;

/* Whether the CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use them. */
static int amx_request(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

__attribute__((constructor)) static void amx_init(void) {
    const char *off = getenv("HOTPREFIX_NO_AMX");
    if (off && *off && strcmp(off, "0")) return;
    amx_granted = amx_request();
    amx_state = amx_granted;
}

int hp_amx(int want) {
    if (want > 0 && amx_granted < 0) amx_granted = amx_request();
    if (want >= 0) amx_state = want && amx_granted > 0;
    return amx_state;
}

int amx_on(void) { return amx_state; }

/* The shapes this thread's tiles have now (the `rows` array they were loaded from; NULL:
 * none, the tiles released). ldtilecfg costs hundreds of cycles (it also zeroes the tiles):
 * loaded once for a thread's run of groups of one shape, not once a group. */
static __thread const uint8_t *amx_cfg;

void amx_release(void) {
    if (!amx_cfg) return;
    _tile_release();
    amx_cfg = NULL;
}

/* The tiles' shapes: tile t has rows[t] rows of colsb[t] bytes (0: unused); nothing when
 * this thread's tiles already have them (rows: a static array, named by its address). */
void amx_load_config(const uint8_t rows[8], const uint16_t colsb[8]) {
    if (amx_cfg == rows) return;
    amx_cfg = rows;
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = rows[t]; c.colsb[t] = colsb[t]; }
    /* not _tile_loadconfig: gcc 12 does not see that it reads c and drops the stores above */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

/* Float sums of tn tiles (16 rows of 16 each) into y's rows, the first `rows` of them (a last
 * tile may be partly rows past x's: not stored), nvalid of the 16 columns. */
void amx_store(const float *acc, int tn, int rows, float *y, int ldy, int nvalid) {
    const __mmask16 keep = nvalid >= G ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    const int n = rows < 16 * tn ? rows : 16 * tn;
    for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(y + (size_t)r * ldy, keep, _mm512_load_ps(acc + 16 * r));
}

/* The 32-value types' codes: with a min (d * code + m), and as nibbles. */
static inline int has_min(int qtype) { return qtype == Q4_1 || qtype == Q5_1; }
static inline int nibbles(int qtype) { return qtype == Q4_0 || qtype == Q4_1; }

/* Blocks b0 .. b0 + n - 1 of a nibble type's group: their B tiles (bt, 512 bytes each), signed
 * codes (the other types' blocks are B tiles as they lie: Q32_B). */
static inline __attribute__((always_inline)) void q32_slice(const int qtype, const uint8_t *gp, int b0, int n,
                                                            uint8_t *bt) {
    const int ub = unit_bytes(qtype), co = has_min(qtype) ? 64 : 32;
    const __m512i eight = _mm512_set1_epi8(8);
    for (int s = 0; s < n; s++) {
        const uint8_t *u = gp + (size_t)(b0 + s) * ub + co;
        __m512i W[8];
        nibble_codes(u, W);
        for (int i = 0; i < 8; i++)
            _mm512_store_si512(bt + 512 * s + 64 * i, qtype == Q4_0 ? _mm512_sub_epi8(W[i], eight) : W[i]);
    }
}

/* The float steps of block b for the 16 rows of a tile (c: its int32 sums, row-major),
 * as int8_q32.c's group_vnni does them. */
static inline __attribute__((always_inline)) void q32_epilogue(const int qtype, const uint8_t *u, const int32_t *c,
                                                               int nb, int b, const float *dx, const float *sx,
                                                               __m512 *acc) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)u));
    const __m512 mw = has_min(qtype) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + 32))) : dw;
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        const size_t xo = (size_t)r * nb + b;
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
        acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, _mm512_set1_ps(dx[xo])), acc[r]);
        if (has_min(qtype)) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[xo]), acc[r]);
    }
}

/* One block's tile product: C(ct) = A(at) . B(bt_), block s of the slice: its B tile from the
 * slice (bt) for nibbles, else from the group's block itself (its codes are signed bytes
 * already: q32_slice would copy them unchanged). */
#define Q32_B(s) (nibbles(qtype) ? bt + 512 * (s) : gp + (size_t)(b0 + (s)) * ub + (has_min(qtype) ? 64 : 32))
#define Q32_DOT(ct, at, bt_, s) do { _tile_zero(ct); _tile_loadd(at, xq + (size_t)(b0 + (s)) * QK, K); \
    _tile_loadd(bt_, Q32_B(s), 64); _tile_dpbssd(ct, at, bt_); } while (0)

/* A tile of 16 rows of x (xq, dx, sx at its first row) against a slice of n blocks from
 * b0 (q32_slice), added into acc (16 rows of 16 floats; the first slice, b0 = 0, sets it). */
static inline __attribute__((always_inline)) void q32_tile(
        const int qtype, const uint8_t *gp, int b0, int n, const uint8_t *bt, int nb, const int8_t *xq,
        const float *dx, const float *sx, int K, float *acc) {
    const int ub = unit_bytes(qtype);
    int32_t c[2][256] __attribute__((aligned(64)));  /* each C tile's sums, read by its epilogue */
    __m512 a[16];
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) a[r] = b0 ? _mm512_load_ps(acc + 16 * r) : _mm512_setzero_ps();
    /* two blocks' products in flight while an epilogue runs: a C tile's sums are stored, its
     * tile given the block after next, then the stored sums read */
    Q32_DOT(0, 2, 4, 0);
    if (n > 1) Q32_DOT(1, 3, 5, 1);
    for (int s = 0; s < n; s += 2) {
        _tile_stored(0, c[0], 64);
        if (s + 2 < n) Q32_DOT(0, 2, 4, s + 2);
        q32_epilogue(qtype, gp + (size_t)(b0 + s) * ub, c[0], nb, b0 + s, dx, sx, a);
        if (s + 1 < n) {
            _tile_stored(1, c[1], 64);
            if (s + 3 < n) Q32_DOT(1, 3, 5, s + 3);
            q32_epilogue(qtype, gp + (size_t)(b0 + s + 1) * ub, c[1], nb, b0 + s + 1, dx, sx, a);
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < 16; r++) _mm512_store_ps(acc + 16 * r, a[r]);
}

#define SLICE 16   /* blocks whose B tiles (8 KB) stay in L1 while the tiles of x pass */
#define RUN 4      /* tiles of x a run: their float sums (4 KB each) between slices */

/* A group against nt tiles of x from row 0 of x32's pointers (already offset); y's first mr rows. */
static inline __attribute__((always_inline)) void amx_q32(const int qtype, const uint8_t *gp, int nb,
                                                          const int8_t *xq, const float *dx, const float *sx, int K,
                                                          int nt, int mr, float *y, int ldy, int nvalid) {
    uint8_t bt[SLICE * 512] __attribute__((aligned(64)));
    float acc[RUN][256] __attribute__((aligned(64)));
    const int slice = nibbles(qtype) ? SLICE : nb;  /* B tiles read in place: every block at once */
    for (int t0 = 0; t0 < nt; t0 += RUN) {
        const int tn = nt - t0 < RUN ? nt - t0 : RUN;
        for (int b0 = 0; b0 < nb; b0 += slice) {
            const int n = nb - b0 < slice ? nb - b0 : slice;
            if (nibbles(qtype)) q32_slice(qtype, gp, b0, n, bt);
            for (int t = 0; t < tn; t++) {
                const size_t m = (size_t)16 * (t0 + t);
                q32_tile(qtype, gp, b0, n, bt, nb, xq + m * K, dx + m * nb, sx + m * nb, K, acc[t]);
            }
        }
        amx_store(acc[0], tn, mr - 16 * t0, y + (size_t)16 * t0 * ldy, ldy, nvalid);
    }
}

#define AMX_Q32(T) static void amx_##T(const uint8_t *gp, int nb, const int8_t *xq, const float *dx, \
        const float *sx, int K, int nt, int mr, float *y, int ldy, int nvalid) { \
    amx_q32(T, gp, nb, xq, dx, sx, K, nt, mr, y, ldy, nvalid); }
AMX_Q32(Q4_0)
AMX_Q32(Q4_1)
AMX_Q32(Q8_0)
AMX_Q32(Q5_1)

int amx_group_rows(const hp_part *pt, int g, int ldy, int K, int m0, int m1, const xquant *x32, const xquant *xk,
                   float *yg) {
    /* rows past a last whole tile join it as a partial tile (their A rows are rows past m1 of
     * x's scratch, allocated for it: xquant_alloc; their sums are not stored): the tiles'
     * work does not grow with rows, the VNNI kernels' does, and each row's bits are the same */
    const int mr = m1 - m0, nt = mr < 16 ? 0 : (mr + 15) / 16, qt = pt->qtype;
    if (!amx_state || nt < 1) return 0;
    const int nvalid = pt->n - g * G < G ? pt->n - g * G : G;
    if (k_family(qt)) {
        if (!amx_kq(pt, g, K, m0, nt, mr, xk, yg, ldy, nvalid)) return 0;
    } else {
        const int nb = K / QK;
        const uint8_t *gp = pt->w + (size_t)g * nb * unit_bytes(qt);
        const int8_t *xq = x32->q + (size_t)m0 * K;
        const size_t xo = (size_t)m0 * nb;
        void (*f)(const uint8_t *, int, const int8_t *, const float *, const float *, int, int, int, float *, int, int) =
            qt == Q4_0 ? amx_Q4_0 : qt == Q4_1 ? amx_Q4_1 : qt == Q5_1 ? amx_Q5_1 : amx_Q8_0;
        /* tiles 0, 1: C (16 x 16 int32); 2, 3: A (16 rows of x, a block); 4, 5: B (8 rows of 64
         * bytes). Two of each, so that one block's product runs while the other's epilogue
         * reads its sums. */
        static const uint8_t rows[8] = {16, 16, 16, 16, 8, 8};
        static const uint16_t colsb[8] = {64, 64, QK, QK, 64, 64};
        amx_load_config(rows, colsb);
        f(gp, nb, xq, x32->d + xo, x32->sd + xo, K, nt, mr, yg, ldy, nvalid);
    }
    return mr;  /* (the tiles stay configured for the thread's next group: amx_release) */
}
#else
int hp_amx(int want) { (void)want; return 0; }

int amx_on(void) { return 0; }

void amx_release(void) {}

int amx_group_rows(const hp_part *pt, int g, int ldy, int K, int m0, int m1, const xquant *x32, const xquant *xk,
                   float *yg) {
    (void)pt; (void)g; (void)ldy; (void)K; (void)m0; (void)m1; (void)x32; (void)xk; (void)yg;
    return 0;
}
#endif
