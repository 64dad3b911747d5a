/* AMX path: bf16 (TDPBF16PS) and int8 (TDPBSSD) on Intel's tile registers. Compiled with
 * -mamx-tile -mamx-bf16 -mamx-int8; only the table getter is visible. The caller (hcblas.c)
 * has checked CPUID/XCR0 and obtained the process's permission for the tile data state.
 *
 * Tiles 0-3 hold a 32 x 32 block of accumulators (2 x 2 tiles of 16 x 16), tiles 4-5 two
 * 16-row slices of X, tiles 6-7 two 16-column panels of Y; each K step of one tile (32 bf16 or
 * 64 int8) is four tile products. X is packed as 16 x 64-byte tiles, Y as hcblas_pack.inc's
 * panels (whose 64-byte rows are exactly the VNNI-format B tiles AMX reads). */
#include <immintrin.h>
#include "hcblas_kernels.h"
#include "hcblas_pack.inc"

#define TILE 16
#define PANELS_PER_BLOCK 16 /* Y columns kept in L2 while every row block passes: 256 */

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config config = {0};
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = TILE;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* What every thread of one product shares: the packed operands and their geometry. */
typedef struct {
    const hcblas_problem *p;
    const char *xp, *yp;
    size_t KB, Sp;
} amx_job;

/* The block loop for rows [2 * begin, 2 * end) of 16-row tiles, one worker per element type:
 * `dot` is the tile product, `acc_t` the accumulator type handed to the epilogue (32 x 32). Each
 * thread configures its own tiles. */
#define AMX_WORKER(name, dot, acc_t)                                                             \
    static void name(void *arg, size_t begin, size_t end) {                                      \
        const amx_job *job = arg;                                                                \
        const hcblas_problem *p = job->p;                                                        \
        const size_t KB = job->KB, panels = job->Sp / TILE;                                      \
        acc_t out[32 * 32] __attribute__((aligned(64)));                                         \
        configure_tiles();                                                                       \
        for (size_t s_block = 0; s_block < panels; s_block += PANELS_PER_BLOCK) {                \
            size_t s_end = s_block + PANELS_PER_BLOCK < panels ? s_block + PANELS_PER_BLOCK : panels; \
            for (size_t rp = 2 * begin; rp < 2 * end; rp += 2) {                                 \
                const char *a0 = job->xp + rp * KB * 1024, *a1 = a0 + KB * 1024;                 \
                for (size_t sp = s_block; sp < s_end; sp += 2) {                                 \
                    const char *b0 = job->yp + sp * KB * 1024, *b1 = b0 + KB * 1024;             \
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                  \
                    for (size_t kb = 0; kb < KB; kb++) {                                         \
                        _tile_loadd(4, a0 + kb * 1024, 64);                                      \
                        _tile_loadd(5, a1 + kb * 1024, 64);                                      \
                        _tile_loadd(6, b0 + kb * 1024, 64);                                      \
                        _tile_loadd(7, b1 + kb * 1024, 64);                                      \
                        dot(0, 4, 6); dot(1, 4, 7); dot(2, 5, 6); dot(3, 5, 7);                  \
                    }                                                                            \
                    _tile_stored(0, out, 128);                                                   \
                    _tile_stored(1, out + 16, 128);                                              \
                    _tile_stored(2, out + 16 * 32, 128);                                         \
                    _tile_stored(3, out + 16 * 32 + 16, 128);                                    \
                    p->epilogue(p->ctx, rp * TILE, sp * TILE, 32, 32, out, 32);                  \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _tile_release();                                                                         \
    }

AMX_WORKER(rows_bf16, _tile_dpbf16ps, float)
AMX_WORKER(rows_s8, _tile_dpbssd, int32_t)

static int gemm_bf16(const hcblas_problem *p) {
    const size_t Kp = round_up(p->K, 32), KB = Kp / 32, Rp = round_up(p->R, 32), Sp = round_up(p->S, 32);
    uint16_t *xp = aligned_zeroed(Rp * Kp * sizeof(uint16_t));
    uint16_t *yp = pack_y_bf16(p, Kp, Sp);
    if (!xp || !yp) {
        free(xp);
        free(yp);
        return -1;
    }
    /* X as tiles of 16 rows x 32 k: element (r, k) at [(r / 16) * KB + k / 32][r % 16][k % 32]. */
    if (!p->fp32_in && p->x_cs == 1) /* rows of X contiguous: 64-byte copies */
        for (size_t r = 0; r < p->R; r++)
            for (size_t kb = 0; kb < KB; kb++)
                memcpy(xp + ((r / TILE) * KB + kb) * 512 + (r % TILE) * 32,
                       (const uint16_t *)p->x + (ptrdiff_t)r * p->x_rs + kb * 32,
                       (kb * 32 + 32 <= p->K ? 32 : p->K - kb * 32) * sizeof(uint16_t));
    else
        FOR_EACH_X(p, xp[((r / TILE) * KB + k / 32) * 512 + (r % TILE) * 32 + (k & 31)] = x_bf16(p, r, k));
    amx_job job = {p, (const char *)xp, (const char *)yp, KB, Sp};
    run_parallel(rows_bf16, &job, Rp / 32, p->threads);
    free(xp);
    free(yp);
    return 0;
}

static int gemm_s8(const hcblas_problem *p) {
    const size_t Kp = round_up(p->K, 64), KB = Kp / 64, Rp = round_up(p->R, 32), Sp = round_up(p->S, 32);
    int8_t *xp = aligned_zeroed(Rp * Kp);
    int8_t *yp = pack_y_s8(p, Kp, Sp, NULL);
    if (!xp || !yp) {
        free(xp);
        free(yp);
        return -1;
    }
    if (p->x_cs == 1)
        for (size_t r = 0; r < p->R; r++)
            for (size_t kb = 0; kb < KB; kb++)
                memcpy(xp + ((r / TILE) * KB + kb) * 1024 + (r % TILE) * 64,
                       (const int8_t *)p->x + (ptrdiff_t)r * p->x_rs + kb * 64,
                       kb * 64 + 64 <= p->K ? 64 : p->K - kb * 64);
    else
        FOR_EACH_X(p, xp[((r / TILE) * KB + k / 64) * 1024 + (r % TILE) * 64 + (k & 63)] = x_s8(p, r, k));
    amx_job job = {p, (const char *)xp, (const char *)yp, KB, Sp};
    run_parallel(rows_s8, &job, Rp / 32, p->threads);
    free(xp);
    free(yp);
    return 0;
}

static const hcblas_kernels kernels = {"amx", gemm_bf16, gemm_s8};

const hcblas_kernels *hcblas_kernels_amx(void) { return &kernels; }
