/* Per-instruction-set kernels of the llama-architecture decoder (llama_forward.c).
 *
 * Weights stay in their GGUF block formats (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants Q4_K,
 * Q5_K, Q6_K), repacked once at load into column tiles of LLAMA_TILE output features: for
 * each tile, its blocks in order, each block holding the quants of 16 columns x 32 inputs
 * laid out as the int8 dot-product instructions read them (group g of 4 inputs: 16 columns x
 * 4 bytes, 64 bytes), then the 16 fp16 scales d and, for Q4_1/Q5_1, the 16 fp16 offsets m. The
 * bytes per weight are the GGUF's. Q8_0 quants are stored offset by +128 (unsigned), 4-bit
 * quants as nibbles: byte (L, col, i) of the first 256 holds input 4L+i in its low and
 * 16+4L+i in its high nibble, the same pairing as GGUF's own Q4 blocks. Q5_0/Q5_1 add, after those
 * 256 bytes, a 64-byte plane of the fifth bits: byte (col, i) holds in bit g that of input
 * 4g + i (g = 0..7), so group L's low nibbles take bit L and its high nibbles bit 4 + L.
 *
 * A K-quant block is a GGUF super-block of 256 inputs: per column, Q4_K/Q5_K the 8 six-bit
 * sub-block scales sc and mins m as bytes ([sub-block][column]), the fp16 d and dmin; Q6_K
 * the 16 int8 scales of its sub-blocks of 16 ([sub-block][column]) and the fp16 d; then 8
 * sub-blocks of 32 inputs, each laid out as above (Q4_K: the 256 nibble bytes; Q5_K: nibbles
 * and the fifth-bit plane as Q5_0; Q6_K: nibbles and two 64-byte planes of the high two bits,
 * plane p's byte (col, i) holding in bits 2L, 2L+1 those of input 16p + 4L + i). GGUF
 * defines w = (d * sc) * u - dmin * m (Q4_K, Q5_K) and w = (d * sc) * (u - 32) (Q6_K), u the
 * unsigned quant.
 *
 * Activations are quantized per block of 32 to int8 (scale d = max|x|/127, q = rint(x/d)),
 * as llama.cpp does for its Q4/Q8 dot products. A weight block's contribution to output
 * column n of a row is then, with the integer I = sum(u * q) - zero * sum(q):
 *     acc = fma((float)I, d_w * d_a, acc);  and for Q4_1/Q5_1: acc = fma(m_w, d_a * sum(q), acc)
 * where zero is 8 (Q4_0), 16 (Q5_0), 0 (Q4_1, Q5_1) or 128 (Q8_0). A K-quant sub-block s against
 * activation block b contributes, with I = sum(u * q):
 *     Q4_K, Q5_K: acc = fma((float)I, (d * sc_s) * d_a, acc); acc = fma(-(dmin * m_s), d_a * sum(q), acc)
 *     Q6_K: I = sc_2s * (sum_lo(u * q) - 32 sum_lo(q)) + sc_2s+1 * (sum_hi(u * q) - 32 sum_hi(q))
 *           over the block's first and second 16 inputs; acc = fma((float)I, d * d_a, acc)
 * (d * sc and dmin * m are exact in float, I is exact in int32 and in float). Every path
 * (scalar, AVX2, AVX-512)
 * performs exactly these float operations in block order for each (row, column), whatever
 * the number of rows computed together, so results are bitwise equal across row counts and
 * across instruction sets; the integer part is exact. Reductions over a vector (RMSNorm's
 * sum of squares, softmax's denominator) use one canonical order on every path: 16 partial
 * sums (element i into lane i mod 16), folded lane i + lane i+8, then +4, +2, +1; exp() is
 * one polynomial, the same operations on every path. */
#ifndef DSPARK_LLAMA_KERNELS_H
#define DSPARK_LLAMA_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include "isa_dispatch.h"

#define LLAMA_TILE 16   /* output columns per tile */
#define LLAMA_QK 32     /* inputs per quant block */

#define LLAMA_Q4_0 0
#define LLAMA_Q4_1 1
#define LLAMA_Q8_0 2
#define LLAMA_Q5_0 3
#define LLAMA_Q4_K 4
#define LLAMA_Q5_K 5
#define LLAMA_Q6_K 6
#define LLAMA_Q5_1 7
#define LLAMA_FORMATS 8
#define LLAMA_QK_K 256  /* inputs per K-quant super-block */
#define LLAMA_KSUB 8    /* sub-blocks of 32 per super-block */

static inline int llama_is_k(int fmt) { return fmt >= LLAMA_Q4_K && fmt <= LLAMA_Q6_K; }
/* Legacy blocks with an fp16 offset m per column after the scales. */
static inline int llama_has_m(int fmt) { return fmt == LLAMA_Q4_1 || fmt == LLAMA_Q5_1; }
/* Legacy blocks with a plane of fifth bits after the nibbles. */
static inline int llama_has_plane(int fmt) { return fmt == LLAMA_Q5_0 || fmt == LLAMA_Q5_1; }
/* Inputs of one packed block: 32, or a super-block of 256. */
static inline size_t llama_block_inputs(int fmt) { return llama_is_k(fmt) ? LLAMA_QK_K : LLAMA_QK; }
/* Bytes of one packed K-quant sub-block's quants (16 columns x 32 inputs). */
static inline size_t llama_ksub_bytes(int fmt) {
    return fmt == LLAMA_Q6_K ? 256 + 128 : fmt == LLAMA_Q5_K ? 256 + 64 : 256;
}
/* Bytes of a K-quant block's per-column fields, which come first (read before its sub-blocks,
 * so the block streams in order): sc [8][16] bytes, m [8][16] bytes, d, dmin [16] fp16 (Q4_K,
 * Q5_K); sc [16][16] int8, d [16] fp16 (Q6_K). */
static inline size_t llama_kfield_bytes(int fmt) { return fmt == LLAMA_Q6_K ? 256 + 32 : 256 + 64; }
/* Bytes of one packed block (16 columns x llama_block_inputs inputs). */
static inline size_t llama_block_bytes(int fmt) {
    if (llama_is_k(fmt)) return llama_kfield_bytes(fmt) + LLAMA_KSUB * llama_ksub_bytes(fmt);
    if (fmt == LLAMA_Q8_0) return 512 + 32;
    return 256 + (llama_has_plane(fmt) ? 64 : 0) + (llama_has_m(fmt) ? 64 : 32);
}
/* Offset of the fp16 scales inside a block (the fp16 offsets m follow for Q4_1, Q5_1). */
static inline size_t llama_scale_offset(int fmt) {
    return fmt == LLAMA_Q8_0 ? 512 : llama_has_plane(fmt) ? 320 : 256;
}
static inline int llama_zero_point(int fmt) {
    return fmt == LLAMA_Q8_0 ? 128 : fmt == LLAMA_Q4_0 ? 8 : fmt == LLAMA_Q5_0 ? 16 : 0;
}
/* The unsigned quant of input k (0..31) of column c in a packed block or K-quant sub-block
 * (the reference layout the vector paths read): Q8_0 one byte, Q4 a nibble, Q5 a nibble plus
 * bit k / 4 of the column's byte (c, k % 4) in the high-bit plane after the nibbles, Q6_K a
 * nibble plus two bits of plane k / 16. */
static inline int llama_quant_at(const uint8_t *blk, int fmt, int c, int k) {
    const int g = k >> 2, i = k & 3;
    if (fmt == LLAMA_Q8_0) return blk[64 * g + 4 * c + i];
    const uint8_t byte = blk[64 * (g & 3) + 4 * c + i];
    const int u = g < 4 ? byte & 15 : byte >> 4;
    if (fmt == LLAMA_Q6_K) return u | (((blk[256 + 64 * (g >> 2) + 4 * c + i] >> (2 * (g & 3))) & 3) << 4);
    return llama_has_plane(fmt) || fmt == LLAMA_Q5_K ? u | (((blk[256 + 4 * c + i] >> g) & 1) << 4) : u;
}

typedef struct {
    int fmt;                /* LLAMA_Q4_0 ... LLAMA_Q5_1 */
    size_t n, k;            /* output columns (multiple of 16), inputs (multiple of the block's) */
    const uint8_t *data;    /* n / 16 tiles of k / llama_block_inputs blocks */
} llama_matrix;

static inline size_t llama_tile_bytes(const llama_matrix *w) {
    return (w->k / llama_block_inputs(w->fmt)) * llama_block_bytes(w->fmt);
}

/* Rows of activations quantized per block of 32: q [rows][k], and per [rows][k / 32] block
 * the scale d, its integer sum, the sum of its first 16 quants and d * sum. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *sum, *sum_lo;
    size_t k, kb;
} llama_qact;

typedef struct {
    const char *name;
    /* out[r * ldo + c] for the columns of tiles [tile0, tile1) of w and rows [0, rows). */
    void (*matmul)(const llama_matrix *w, size_t tile0, size_t tile1, const llama_qact *a,
                   size_t rows, float *out, size_t ldo);
    /* Quantize x[r * ldx + :k] for rows [0, rows) into a (a->k == k). */
    void (*quantize)(const float *x, size_t ldx, size_t rows, llama_qact *a);
    /* Sum of squares of x[:n] in the canonical order. */
    float (*sum_squares)(const float *x, size_t n);
    /* out[i] = silu(gate[i]) * up[i]. */
    void (*swiglu)(const float *gate, const float *up, size_t n, float *out);
    /* s[h * ls + j] = sum_d q[h][d] * key[j][d] (fma in order of d) for h < nq, j < n;
     * kt holds a head's fp16 keys in blocks of 16 slots, key[j][d] at
     * ((j / 16) * hd + d) * 16 + j % 16 (the slots past n in the last block are read). */
    void (*scores)(const float *const *q, size_t nq, size_t hd, const uint16_t *kt, size_t n,
                   float *s, size_t ls);
    /* p[i] = exp(p[i] - max p) in place for i < n; returns their sum (canonical order). */
    float (*softmax)(float *p, size_t n);
    /* out[h * hd + d] = scale[h] * sum_c p[h * lp + c] * v[idx[c] * hd + d] (fma in order of
     * c) for h < nq; v is a head's fp16 values (slots x dims). */
    void (*values)(const float *p, size_t lp, size_t nq, const float *scale, size_t hd,
                   const uint16_t *v, const int32_t *idx, size_t n, float *out);
} llama_kernels;

/* The canonical exp: Cody-Waite reduction by ln 2 and a degree-6 polynomial, ~2 ulp; the
 * vector paths apply the same operations lane-wise. */
#define LLAMA_EXP_HI 88.3762626647949f
#define LLAMA_EXP_LO -87.3365478515625f
#define LLAMA_LOG2E 1.44269504088896341f
#define LLAMA_LN2_HI 0.693359375f
#define LLAMA_LN2_LO -2.12194440e-4f
#define LLAMA_EXP_P0 1.9875691500e-4f
#define LLAMA_EXP_P1 1.3981999507e-3f
#define LLAMA_EXP_P2 8.3334519073e-3f
#define LLAMA_EXP_P3 4.1665795894e-2f
#define LLAMA_EXP_P4 1.6666665459e-1f
#define LLAMA_EXP_P5 5.0000001201e-1f

DSPARK_HIDDEN const llama_kernels *llama_kernels_scalar(void);
#if DSPARK_HAVE_X86_TUS
DSPARK_HIDDEN const llama_kernels *llama_kernels_avx2(void);
DSPARK_HIDDEN const llama_kernels *llama_kernels_avx512(void);
#endif

/* Dispatch (llama_dispatch.c): the llama family of the common dispatcher, and its tables. */
extern const dspark_isa_family llama_paths;
const llama_kernels *llama_isa_kernels(int isa);

/* IEEE half <-> float, round to nearest even (what F16C does), for the portable code. */
static inline float llama_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            int e = -1;
            do { mant <<= 1; e++; } while (!(mant & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t llama_float_to_half(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u)  /* inf or nan */
        return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u | ((absx >> 13) & 0x3ffu) : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds to >= 65520: inf */
    if (absx < 0x38800000u) {  /* below the smallest normal half: subnormal or zero */
        if (absx < 0x33000000u) return (uint16_t)sign;  /* < 2^-25 rounds to 0 */
        uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(absx >> 23);  /* value / 2^-24 = mant >> shift */
        uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1u), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = ((absx >> 13) - ((127 - 15) << 10));
    uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

#endif
