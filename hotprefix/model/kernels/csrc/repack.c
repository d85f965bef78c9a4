/* The regrouped layouts of the int8 products.
 *
 * Weight rows are regrouped by 16 (G) so that one vector instruction multiplies 4
 * consecutive weights of 8 or 16 rows by the same 4 activations: each 32-bit lane is one
 * output row, so no horizontal sums are needed and each weight vector serves every row of
 * x. A unit is 16 rows x one GGUF block; units follow block by block within a group, and
 * groups follow each other (rows past N are zero). In a "chunk" of 64 bytes, byte 4r + t
 * belongs to row r of the group and value t of a 4-value slice.
 *
 * 32-value types (one unit = 16 blocks):
 *   Q4_0  d fp16[16] | codes: 4 chunks; chunk i: code(k=4i+t) | code(k=16+4i+t) << 4
 *   Q4_1  d fp16[16] | m fp16[16] | codes as Q4_0
 *   Q8_0  d fp16[16] | codes: 8 chunks; chunk i: q(k=4i+t) (int8)
 *   Q5_0  as Q8_0, with q = code - 16 (exact; 1.5x the GGUF bytes)
 *   Q5_1  d fp16[16] | m fp16[16] | codes: 8 chunks of code(k=4i+t) (uint8, 0..31)
 * K-quant types (one unit = 16 super-blocks of 256):
 *   Q4_K  d fp16[16] | dmin fp16[16] | scales u8[4][16][2] | mins u8[4][16][2] |
 *         codes: for each of the 8 sub-blocks of 32, 4 chunks as Q4_0's
 *         ([p][row][e] = sub-block 2p+e of the row: a row's pair sits in one 32-bit lane)
 *   Q5_K  Q4_K's, then the fifth bits: for each sub-block a chunk whose byte 4r+t holds
 *         bit i = code(k=4i+t) >> 4 and bit 4+i = code(k=16+4i+t) >> 4
 *   Q6_K  d fp16[16] | scales i8[8][16][2] | low 4 bits: for each of the 16 sub-blocks
 *         of 16, 2 chunks; chunk i: low(k=4i+t) | low(k=8+4i+t) << 4 | top 2 bits: for
 *         each sub-block a chunk, bits 2i..2i+1 = code(k=4i+t) >> 4; codes 0..63 (q + 32)
 * All are within 3% of the GGUF bytes except Q5_0/Q5_1 (the fallbacks of small models).
 */
#include "hp.h"
#include "hp_api.h"
#include "int8_kq.h"


int unit_bytes(int qtype) {
    switch (qtype) {
        case Q4_0: return 288;
        case Q4_1: return 320;
        case Q8_0: case Q5_0: return 544;
        case Q5_1: return 576;
        case Q4_K: return 2368;
        case Q5_K: return 2880;
        case Q6_K: return 3360;
        default: return 0;
    }
}

/* Bytes of the regrouped form of an [N, K] weight (N rounded up to 16). */
long hp_repacked_bytes(int qtype, int N, int K) {
    if (!unit_bytes(qtype) || K % block_values(qtype)) return -1;
    return (long)((N + G - 1) / G) * (K / block_values(qtype)) * unit_bytes(qtype);
}

/* The 32 codes of a Q5_0/Q5_1 block (0..31). */
static void codes_q5(int qtype, const uint8_t *src, int *q) {
    const int off = qtype == Q5_1 ? 4 : 2;
    uint32_t qh; memcpy(&qh, src + off, 4);
    const uint8_t *qs = src + off + 4;
    for (int k = 0; k < 16; k++) {
        q[k] = (qs[k] & 0x0f) | (((qh >> k) & 1) << 4);
        q[k + 16] = (qs[k] >> 4) | (((qh >> (k + 16)) & 1) << 4);
    }
}

/* Row j of a 32-value unit u from the GGUF block src. */
static void repack_q32(int qtype, const uint8_t *src, int j, uint8_t *u) {
    const int has_m = qtype == Q4_1 || qtype == Q5_1;
    memcpy(u + 2 * j, src, 2);
    if (has_m) memcpy(u + 32 + 2 * j, src + 2, 2);
    uint8_t *codes = u + (has_m ? 64 : 32);
    if (qtype == Q4_0 || qtype == Q4_1) {
        const uint8_t *qs = src + (has_m ? 4 : 2);
        for (int k = 0; k < QK; k++) {
            const int i = (k % 16) / 4, t = k % 4;
            const uint8_t c = k < 16 ? qs[k] & 0x0f : qs[k - 16] >> 4;
            codes[i * 64 + 4 * j + t] |= (uint8_t)(k < 16 ? c : c << 4);
        }
        return;
    }
    int q[QK];
    if (qtype == Q8_0) for (int k = 0; k < QK; k++) q[k] = (int8_t)src[2 + k];
    else codes_q5(qtype, src, q);
    for (int k = 0; k < QK; k++)
        codes[(k / 4) * 64 + 4 * j + k % 4] = (uint8_t)(qtype == Q5_0 ? q[k] - 16 : q[k]);
}

static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline void st32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* Row j of a Q4_K/Q5_K unit u from the GGUF super-block src. Every byte of the row's
 * lanes is stored once (no read-modify-write): four at a time, as 32-bit words whose
 * byte t is value t of a 4-value slice (little-endian, as the kernels read them). */
static void repack_q45k(int qtype, const uint8_t *src, int j, uint8_t *u) {
    memcpy(u + 2 * j, src, 2);
    memcpy(u + 32 + 2 * j, src + 2, 2);
    const uint8_t *sc = src + 4, *qh = src + 16, *qs = src + (qtype == Q5_K ? 48 : 16);
    for (int s = 0; s < 8; s++) {
        int d, m;
        if (s < 4) { d = sc[s] & 63; m = sc[s + 4] & 63; }
        else { d = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4); m = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4); }
        u[K45_SC + 32 * (s / 2) + 2 * j + s % 2] = (uint8_t)d;
        u[K45_MN + 32 * (s / 2) + 2 * j + s % 2] = (uint8_t)m;
        /* sub-block s: the low (s even) or high nibbles of qs[32 (s / 2) ..]; slice i of
         * the chunk holds values 4i + t (low nibble) and 16 + 4i + t (high) */
        const uint8_t *q = qs + (s / 2) * 32;
        for (int i = 0; i < 4; i++) {
            const uint32_t lo = ld32(q + 4 * i), hi = ld32(q + 16 + 4 * i);
            const uint32_t w = s % 2 ? ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u)
                                     : (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
            st32(u + K45_CODES + 256 * s + 64 * i + 4 * j, w);
        }
        if (qtype != Q5_K) continue;
        /* byte t: bit i = the fifth bit of value 4i + t, bit 4 + i that of 16 + 4i + t */
        uint32_t hw = 0;
        for (int i = 0; i < 4; i++) {
            hw |= ((ld32(qh + 4 * i) >> s) & 0x01010101u) << i;
            hw |= ((ld32(qh + 16 + 4 * i) >> s) & 0x01010101u) << (4 + i);
        }
        st32(u + K5_HI + 64 * s + 4 * j, hw);
    }
}

/* Row j of a Q6_K unit u from the GGUF super-block src, a 32-bit word at a time as
 * repack_q45k. Sub-block sb holds values 16 sb .. 16 sb + 15: in GGUF's order half
 * h = sb / 8, quarter q4 = (sb % 8) / 2 (its low bits: a nibble of ql, its top bits 2
 * bits of qh), and from l = 16 (sb % 2) on within the quarter's 32. */
static void repack_q6k(const uint8_t *src, int j, uint8_t *u) {
    const uint8_t *ql = src, *qh = src + 128, *sc = src + 192;
    memcpy(u + 2 * j, src + 208, 2);
    for (int s = 0; s < 16; s++) u[K6_SC + 32 * (s / 2) + 2 * j + s % 2] = sc[s];
    for (int sb = 0; sb < 16; sb++) {
        const int h = sb / 8, q4 = (sb % 8) / 2, l0 = 16 * (sb % 2);
        const uint8_t *lo = ql + h * 64 + (q4 % 2) * 32 + l0, *hi = qh + h * 32 + l0;
        const int shl = 4 * (q4 / 2), shh = 2 * q4;
        for (int a = 0; a < 2; a++) {  /* chunk a: values 4a + t (low nibble) and 8 + 4a + t (high) */
            const uint32_t v0 = (ld32(lo + 4 * a) >> shl) & 0x0F0F0F0Fu, v1 = (ld32(lo + 8 + 4 * a) >> shl) & 0x0F0F0F0Fu;
            st32(u + K6_LO + 128 * sb + 64 * a + 4 * j, v0 | (v1 << 4));
        }
        uint32_t w = 0;  /* byte t: bits 2i..2i+1 = the top bits of value 4i + t */
        for (int i = 0; i < 4; i++) w |= ((ld32(hi + 4 * i) >> shh) & 0x03030303u) << (2 * i);
        st32(u + K6_HI + 64 * sb + 4 * j, w);
    }
}

/* GGUF rows w [N, K / block values blocks] -> the regrouped layout above. Returns 0, or
 * -1 for a type without a layout or K not a multiple of its block. */
int hp_repack(int qtype, const uint8_t *w, int N, int K, uint8_t *out) {
    const long total = hp_repacked_bytes(qtype, N, K);
    if (total < 0) return -1;
    const int nb = K / block_values(qtype), bb = block_bytes(qtype), ub = unit_bytes(qtype);
    const int groups = (N + G - 1) / G;
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < groups; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *u = out + ((size_t)g * nb + b) * ub;
            /* unit by unit: one pass over the output, touched by its thread. The K-quants
             * store every byte of a row's lanes: only the padding rows of a last group
             * need zeros; the 32-value types OR their codes in. */
            if (!k_family(qtype) || (g + 1) * G > N) memset(u, 0, (size_t)ub);
            for (int j = 0; j < G && g * G + j < N; j++) {
                const uint8_t *src = w + ((size_t)(g * G + j) * nb + b) * bb;
                if (qtype == Q6_K) repack_q6k(src, j, u);
                else if (qtype == Q4_K || qtype == Q5_K) repack_q45k(qtype, src, j, u);
                else repack_q32(qtype, src, j, u);
            }
        }
    return 0;
}
