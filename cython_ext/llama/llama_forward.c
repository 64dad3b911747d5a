/* The llama decoder step over the per-ISA kernels, run by a small pthread pool.
 *
 * One file on purpose (~800 lines): the pool, the phases of a step and the architecture's
 * options share one work-item scheme and ordering rules that make every row count and thread
 * schedule give the same bits; split up, those rules would be spread over several files.
 *
 * Threads: the pool holds `threads - 1` workers; the calling thread is thread 0. A forward is
 * one parallel region made of phases (per layer: QKV product, attention, output product,
 * gate/up product, down product). Each phase is a list of work items (a few column tiles of a
 * product, or one (row, KV head) of attention) that threads claim with an atomic counter; a
 * phase starts once every item of the previous one is done. A column is always computed by
 * one thread in one order, so which thread takes which item never changes a result, and a
 * thread that the OS deschedules (2 cores shared with the server, a drafter, other processes)
 * does not hold the others at a barrier: they take its items, and it skips the phases that
 * are already taken when it runs again. Elementwise work before a product (RMSNorm, SwiGLU,
 * activation quantization) is done by each participating thread for all rows into its own
 * buffer, cheaper than another phase at decoding's row counts. Between forwards the workers
 * spin briefly, then sleep on a futex. Concurrent callers are serialized by a mutex. */
#define _GNU_SOURCE
#include "llama_forward.h"
#include "dspark_probes.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* ---- pool ---------------------------------------------------------------------------- */

typedef void (*llama_job)(void *arg, int tid);

struct llama_pool {
    int n;
    pthread_t *threads;
    pthread_mutex_t run_lock;
    llama_job job;
    void *arg;
    _Atomic uint32_t epoch;    /* bumped per job; workers wait on it */
    _Atomic int sleepers;
    _Atomic int done;
    _Atomic int stop;
};

#define WORKER_SPINS 4000   /* pauses before a worker sleeps (~0.1-0.5 ms) */
#define WAIT_SPINS 2000    /* pauses before a thread waiting on a phase yields the core */

static void futex_wait(_Atomic uint32_t *word, uint32_t value) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)word, (void)value;
    sched_yield();
#endif
}

static void futex_wake_all(_Atomic uint32_t *word) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)word;
#endif
}

typedef struct {
    llama_pool *pool;
    int tid;
} worker_arg;

static void *worker_main(void *p) {
    worker_arg w = *(worker_arg *)p;
    free(p);
    llama_pool *pool = w.pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t e;
        int spins = 0;
        while ((e = atomic_load(&pool->epoch)) == seen) {
            if (++spins < WORKER_SPINS) {
                CPU_RELAX();
                continue;
            }
            atomic_fetch_add(&pool->sleepers, 1);
            futex_wait(&pool->epoch, seen);
            atomic_fetch_sub(&pool->sleepers, 1);
        }
        seen = e;
        if (atomic_load(&pool->stop)) return NULL;
        pool->job(pool->arg, w.tid);
        atomic_fetch_add(&pool->done, 1);
    }
}

llama_pool *llama_pool_new(int threads) {
    llama_pool *pool = calloc(1, sizeof(*pool));
    if (!pool) return NULL;
    pool->n = threads < 1 ? 1 : threads;
    pthread_mutex_init(&pool->run_lock, NULL);
    pool->threads = calloc((size_t)pool->n, sizeof(pthread_t));
    if (!pool->threads) {
        free(pool);
        return NULL;
    }
    for (int t = 1; t < pool->n; t++) {
        worker_arg *w = malloc(sizeof(*w));
        if (!w || (w->pool = pool, w->tid = t, pthread_create(&pool->threads[t], NULL, worker_main, w)) != 0) {
            free(w);
            pool->n = t;  /* run with the threads that started */
            break;
        }
    }
    return pool;
}

void llama_pool_free(llama_pool *pool) {
    if (!pool) return;
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->epoch, 1);
    futex_wake_all(&pool->epoch);
    for (int t = 1; t < pool->n; t++) pthread_join(pool->threads[t], NULL);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->threads);
    free(pool);
}

int llama_pool_threads(const llama_pool *pool) { return pool->n; }

static void pool_run(llama_pool *pool, llama_job job, void *arg) {
    pthread_mutex_lock(&pool->run_lock);
    pool->job = job;
    pool->arg = arg;
    atomic_store(&pool->done, 0);
    atomic_fetch_add(&pool->epoch, 1);
    if (atomic_load(&pool->sleepers) > 0) futex_wake_all(&pool->epoch);
    job(arg, 0);
    int spins = 0;
    while (atomic_load(&pool->done) < pool->n - 1)
        if (++spins < WAIT_SPINS) CPU_RELAX();
        else sched_yield();
    pthread_mutex_unlock(&pool->run_lock);
}

/* ---- forward --------------------------------------------------------------------------- */

/* A phase's work items: claimed by fetch_add on `claimed`, counted in `done` when finished. */
typedef struct {
    _Atomic uint32_t claimed, done;
    uint32_t total;
    char pad[64 - 3 * sizeof(uint32_t)];
} phase;

#define ATT_ROWS 4  /* rows of a segment whose scores are computed in one pass over the keys */

typedef struct {
    size_t r0, rows;  /* rows [r0, r0 + rows) of one segment */
} att_block;

typedef struct {
    float *tmp;      /* [rows][max(hidden, ffn)]: normed or gated rows, the quantizer's input */
    llama_qact qa;   /* quantized tmp (k set per use) */
    float *scores;   /* [ATT_ROWS * group][max_slots] */
    float *probs;    /* [group][max_slots] */
    int32_t *idx;    /* [max_slots]: the visible slots of a row */
    int32_t *iota;   /* [max_slots]: 0, 1, 2, ... */
} thread_scratch;

typedef struct {
    const llama_model *m;
    const llama_kernels *kern;
    const llama_request *req;
    llama_pool *pool;
    size_t rows, max_slots, n_qkv;
    size_t k_in;         /* a projection's input width when wider than the model's rows */
    int32_t *row_seg;    /* [rows] segment of each row */
    int32_t *row_first;  /* [rows] the segment's first row */
    float *rope;         /* [rows][head_dim]: cos, sin per pair */
    float *rope_local;   /* the same with rope_base_local (sliding-window layers of gemma3) */
    float *x;            /* [rows][hidden] residual stream */
    float *qkv;          /* [rows][n_qkv] */
    float *attn;         /* [rows][n_head * head_dim] */
    float *gu;           /* [rows][2 * ffn] */
    float *proj;         /* [rows][hidden] output of wo / down before the residual add */
    att_block *att_blocks;  /* [n_att_blocks] the rows attention takes together */
    size_t n_att_blocks;
    phase *phases;       /* [n_phases] */
    size_t n_phases;
    thread_scratch *ts;  /* [threads] */
} fwd_state;

static int phase_open(phase *p) { return atomic_load(&p->claimed) < p->total; }

static void phase_wait(phase *p) {
    int spins = 0;
    while (atomic_load(&p->done) < p->total)
        if (++spins < WAIT_SPINS) CPU_RELAX();
        else sched_yield();
}

/* The next unclaimed item, or -1. */
static long phase_claim(phase *p) {
    const uint32_t i = atomic_fetch_add(&p->claimed, 1);
    return i < p->total ? (long)i : -1;
}

static void phase_finish(phase *p) { atomic_fetch_add(&p->done, 1); }

/* A K-quant column as GGUF dequantizes it: (d * sc) * u - dmin * m, (d * sc) * (u - 32). */
static void embed_dequant_k(const llama_matrix *w, size_t col, float *x) {
    const int fmt = w->fmt, c = (int)(col % LLAMA_TILE);
    const size_t nsb = w->k / LLAMA_QK_K, bb = llama_block_bytes(fmt), sb = llama_ksub_bytes(fmt);
    const uint8_t *tile = w->data + (col / LLAMA_TILE) * llama_tile_bytes(w);
    for (size_t B = 0; B < nsb; B++) {
        const uint8_t *f = tile + B * bb, *blk = f + llama_kfield_bytes(fmt);
        uint16_t h;
        memcpy(&h, f + 256 + 2 * c, 2);
        const float d = llama_half_to_float(h);
        memcpy(&h, f + 288 + 2 * c, 2);
        const float dmin = fmt == LLAMA_Q6_K ? 0.0f : llama_half_to_float(h);
        for (int s = 0; s < LLAMA_KSUB; s++) {
            float *xs = x + (B * LLAMA_KSUB + s) * LLAMA_QK;
            for (int k = 0; k < LLAMA_QK; k++) {
                const int u = llama_quant_at(blk + s * sb, fmt, c, k);
                if (fmt == LLAMA_Q6_K)
                    xs[k] = d * (float)((const int8_t *)f)[32 * s + 16 * (k >> 4) + c] * (float)(u - 32);
                else
                    xs[k] = d * (float)f[16 * s + c] * (float)u - dmin * (float)f[128 + 16 * s + c];
            }
        }
    }
}

static void embed_dequant(const llama_matrix *w, size_t col, float *x) {
    if (llama_is_k(w->fmt)) {
        embed_dequant_k(w, col, x);
        return;
    }
    const size_t kb = w->k / LLAMA_QK, bb = llama_block_bytes(w->fmt), so = llama_scale_offset(w->fmt);
    const uint8_t *tile = w->data + (col / LLAMA_TILE) * llama_tile_bytes(w);
    const int c = (int)(col % LLAMA_TILE), zero = llama_zero_point(w->fmt);
    for (size_t b = 0; b < kb; b++) {
        const uint8_t *blk = tile + b * bb;
        uint16_t h;
        memcpy(&h, blk + so + 2 * c, 2);
        const float d = llama_half_to_float(h);
        float m = 0.0f;
        if (llama_has_m(w->fmt)) {
            memcpy(&h, blk + so + 32 + 2 * c, 2);
            m = llama_half_to_float(h);
        }
        for (int k = 0; k < LLAMA_QK; k++)
            x[b * LLAMA_QK + k] = d * (float)(llama_quant_at(blk, w->fmt, c, k) - zero) + m;
    }
}

void llama_embed_row(const llama_model *m, int32_t token, float *x) {
    embed_dequant(&m->embed, (size_t)token, x);
}

/* tmp[r] = x[r] / rms(x[r]) * w (x[r] itself when w is NULL) for every row (rows
 * row_index[r] of x when given), then quantized into the thread's buffer. */
static void norm_quantize(fwd_state *st, thread_scratch *ts, const float *x, size_t rows,
                          const int32_t *row_index, const float *w) {
    const size_t d = st->m->hidden;
    for (size_t i = 0; i < rows; i++) {
        const float *xr = x + (row_index ? (size_t)row_index[i] : i) * d;
        float *out = ts->tmp + i * d;
        if (!w) {
            memcpy(out, xr, d * sizeof(float));
            continue;
        }
        const float scale = 1.0f / sqrtf(st->kern->sum_squares(xr, d) / (float)d + st->m->rms_eps);
        for (size_t k = 0; k < d; k++) out[k] = xr[k] * scale * w[k];
    }
    ts->qa.k = d;
    ts->qa.kb = d / LLAMA_QK;
    st->kern->quantize(ts->tmp, d, rows, &ts->qa);
}

static void quantize_rows(fwd_state *st, thread_scratch *ts, const float *x, size_t ld, size_t k,
                          size_t rows) {
    ts->qa.k = k;
    ts->qa.kb = k / LLAMA_QK;
    st->kern->quantize(x, ld, rows, &ts->qa);
}

static size_t group_tiles(const llama_matrix *mats, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += mats[i].n / LLAMA_TILE;
    return total;
}

/* Tiles per work item of a product: at least 4, and about 8 items per thread. */
static size_t chunk_tiles(size_t tiles, int nt) {
    const size_t per = (tiles + 8 * (size_t)nt - 1) / (8 * (size_t)nt);
    return per < 4 ? 4 : per;
}

/* Item `item` of a product over the tiles of mats[0..n) (outputs side by side in out); sets
 * the columns [*col0, *col1) it computed. */
static void matmul_item(fwd_state *st, thread_scratch *ts, const llama_matrix *mats, int n,
                        size_t item, size_t rows, float *out, size_t ldo, size_t *col0,
                        size_t *col1) {
    const size_t total = group_tiles(mats, n), chunk = chunk_tiles(total, st->pool->n);
    const size_t begin = item * chunk, end = begin + chunk < total ? begin + chunk : total;
    *col0 = begin * LLAMA_TILE;
    *col1 = end * LLAMA_TILE;
    size_t base = 0;
    for (int i = 0; i < n; i++) {
        const size_t tiles = mats[i].n / LLAMA_TILE;
        const size_t lo = begin > base ? begin - base : 0;
        const size_t hi = end - base < tiles ? end - base : tiles;
        if (end > base && lo < hi)
            st->kern->matmul(&mats[i], lo, hi, &ts->qa, rows, out + base * LLAMA_TILE, ldo);
        base += tiles;
    }
}

static uint32_t matmul_items(fwd_state *st, const llama_matrix *mats, int n) {
    const size_t total = group_tiles(mats, n), chunk = chunk_tiles(total, st->pool->n);
    return (uint32_t)((total + chunk - 1) / chunk);
}

static const float *rope_of(const fwd_state *st, const llama_layer *L, size_t r) {
    return (L->local_rope ? st->rope_local : st->rope) + r * st->m->head_dim;
}

static uint16_t *key_slot(const fwd_state *st, const llama_segment *seg, size_t layer, size_t g, size_t slot) {
    const size_t hd = st->m->head_dim;
    return seg->k + ((layer * st->m->n_kv + g) * (seg->cap / 16) + slot / 16) * hd * 16 + slot % 16;
}

static uint16_t *value_slot(const fwd_state *st, const llama_segment *seg, size_t layer, size_t g, size_t slot) {
    const size_t hd = st->m->head_dim;
    return seg->v + ((layer * st->m->n_kv + g) * seg->cap + slot) * hd;
}

/* Whether a layer's q/k/v need whole rows after their product (a bias, per-head norms or NEOX
 * pairs that span tiles): then qkv_row runs as a phase of its own; else qkv_epilogue per tile. */
static int qkv_by_rows(const llama_model *m, const llama_layer *L) {
    return m->rope_neox || L->q_norm || L->k_norm || L->qkv_bias;
}

/* RoPE on the q and k columns [c0, c1), k and v into the caches, q scaled by 1/sqrt(hd).
 * [c0, c1) is whole tiles, and a 16-column tile lies inside one head (hd % 64 == 0). */
static void qkv_epilogue(fwd_state *st, size_t layer, size_t c0, size_t c1) {
    const llama_model *m = st->m;
    const size_t hd = m->head_dim, nq = m->n_head * hd, nk = m->n_kv * hd;
    const float qscale = 1.0f / sqrtf((float)hd);
    for (size_t r = 0; r < st->rows; r++) {
        const llama_segment *seg = &st->req->segs[st->row_seg[r]];
        const size_t slot = seg->length + (r - (size_t)st->row_first[r]);
        float *row = st->qkv + r * st->n_qkv;
        const float *cs = rope_of(st, &m->layers[layer], r);  /* cos, sin of pair i at 2i, 2i + 1 */
        for (size_t c = c0; c < c1; c += LLAMA_TILE) {
            float *x = row + c;
            if (c < nq + nk) {
                const size_t d0 = (c < nq ? c : c - nq) % hd;
                for (size_t i = 0; i < LLAMA_TILE; i += 2) {
                    const float x0 = x[i], x1 = x[i + 1], cos_ = cs[d0 + i], sin_ = cs[d0 + i + 1];
                    x[i] = x0 * cos_ - x1 * sin_;
                    x[i + 1] = x0 * sin_ + x1 * cos_;
                }
            }
            if (c < nq) {
                for (size_t i = 0; i < LLAMA_TILE; i++) x[i] *= qscale;
            } else if (c < nq + nk) {
                const size_t g = (c - nq) / hd, d0 = (c - nq) % hd;
                uint16_t *kt = key_slot(st, seg, layer, g, slot) + d0 * 16;
                for (size_t i = 0; i < LLAMA_TILE; i++) kt[i * 16] = llama_float_to_half(x[i]);
            } else {
                const size_t g = (c - nq - nk) / hd, d0 = (c - nq - nk) % hd;
                uint16_t *v = value_slot(st, seg, layer, g, slot) + d0;
                for (size_t i = 0; i < LLAMA_TILE; i++) v[i] = llama_float_to_half(x[i]);
            }
        }
    }
}

/* x[:hd] = x / rms(x) * w, the same operations as the hidden-size RMSNorm. */
static void head_norm(const fwd_state *st, float *x, const float *w) {
    const size_t hd = st->m->head_dim;
    const float scale = 1.0f / sqrtf(st->kern->sum_squares(x, hd) / (float)hd + st->m->rms_eps);
    for (size_t i = 0; i < hd; i++) x[i] = x[i] * scale * w[i];
}

/* RoPE of one head in place; cs holds cos, sin of pair i at 2i, 2i + 1. */
static void rope_head(float *x, const float *cs, size_t hd, int neox) {
    const size_t half = hd / 2;
    for (size_t i = 0; i < half; i++) {
        float *a = neox ? x + i : x + 2 * i, *b = neox ? x + i + half : x + 2 * i + 1;
        const float x0 = *a, x1 = *b, cos_ = cs[2 * i], sin_ = cs[2 * i + 1];
        *a = x0 * cos_ - x1 * sin_;
        *b = x0 * sin_ + x1 * cos_;
    }
}

/* Row r's q, k, v after their product: bias, per-head norms, RoPE, q scaled by 1/sqrt(hd), k and
 * v into the cache. */
static void qkv_row(fwd_state *st, size_t layer, size_t r) {
    const llama_model *m = st->m;
    const llama_layer *L = &m->layers[layer];
    const size_t hd = m->head_dim, nq = m->n_head * hd, nk = m->n_kv * hd;
    const float qscale = 1.0f / sqrtf((float)hd);
    const llama_segment *seg = &st->req->segs[st->row_seg[r]];
    const size_t slot = seg->length + (r - (size_t)st->row_first[r]);
    float *row = st->qkv + r * st->n_qkv;
    const float *cs = rope_of(st, L, r);
    if (L->qkv_bias)
        for (size_t c = 0; c < st->n_qkv; c++) row[c] += L->qkv_bias[c];
    for (size_t h = 0; h < m->n_head; h++) {
        float *x = row + h * hd;
        if (L->q_norm) head_norm(st, x, L->q_norm);
        rope_head(x, cs, hd, m->rope_neox);
        for (size_t i = 0; i < hd; i++) x[i] *= qscale;
    }
    for (size_t g = 0; g < m->n_kv; g++) {
        float *x = row + nq + g * hd, *v = row + nq + nk + g * hd;
        if (L->k_norm) head_norm(st, x, L->k_norm);
        rope_head(x, cs, hd, m->rope_neox);
        uint16_t *kt = key_slot(st, seg, layer, g, slot), *vt = value_slot(st, seg, layer, g, slot);
        for (size_t i = 0; i < hd; i++) {
            kt[i * 16] = llama_float_to_half(x[i]);
            vt[i] = llama_float_to_half(v[i]);
        }
    }
}

/* The position of cached slot j of a segment (j < length: the cache's; else a new row's). */
static int64_t slot_position(const llama_segment *seg, size_t j) {
    if (j >= seg->length) return seg->positions[j - seg->length];
    return seg->past_positions ? seg->past_positions[j] : (int64_t)j;
}

/* Attention of one KV head for a block of up to ATT_ROWS rows of one segment: the rows' query
 * heads score every slot in one pass over the keys, then each row takes the slots its mask
 * shows. Items run KV-head-major, so a head's keys and values stay in cache across a step. */
static void attention_item(fwd_state *st, thread_scratch *ts, size_t layer, size_t item) {
    const llama_model *m = st->m;
    const size_t hd = m->head_dim, group = m->n_head / m->n_kv;
    const size_t g = item / st->n_att_blocks, r0 = st->att_blocks[item % st->n_att_blocks].r0;
    const size_t nr = st->att_blocks[item % st->n_att_blocks].rows;
    const llama_segment *seg = &st->req->segs[st->row_seg[r0]];
    const size_t width = seg->length + seg->t;
    const uint16_t *kt = seg->k + (layer * m->n_kv + g) * (seg->cap / 16) * hd * 16;
    const uint16_t *v = seg->v + (layer * m->n_kv + g) * seg->cap * hd;
    const size_t window = m->layers[layer].window;
    const float *q[ATT_ROWS * 64];
    size_t visible[ATT_ROWS], most = 0;
    for (size_t i = 0; i < nr; i++) {
        const uint8_t *mask = seg->mask + (r0 + i - (size_t)st->row_first[r0]) * width;
        size_t n = width;
        while (n > 0 && !mask[n - 1]) n--;
        visible[i] = n;
        most = n > most ? n : most;
        for (size_t h = 0; h < group; h++) q[i * group + h] = st->qkv + (r0 + i) * st->n_qkv + (g * group + h) * hd;
    }
    if (most) st->kern->scores(q, nr * group, hd, kt, most, ts->scores, st->max_slots);
    for (size_t i = 0; i < nr; i++) {
        const uint8_t *mask = seg->mask + (r0 + i - (size_t)st->row_first[r0]) * width;
        const size_t n = visible[i];
        float *out = st->attn + (r0 + i) * m->n_head * hd + g * group * hd;
        float *sc = ts->scores + i * group * st->max_slots, scale[64];
        if (n == 0) {
            memset(out, 0, group * hd * sizeof(float));
            continue;
        }
        /* a sliding window hides the slots `window` or more positions back */
        const int64_t pos = st->req->segs[st->row_seg[r0]].positions[r0 + i - (size_t)st->row_first[r0]];
        const int windowed = window && pos >= (int64_t)window;
        if (!windowed && !memchr(mask, 0, n)) {  /* sees every slot up to n: the compact list is 0..n-1 */
            for (size_t h = 0; h < group; h++)
                scale[h] = 1.0f / st->kern->softmax(sc + h * st->max_slots, n);
            st->kern->values(sc, st->max_slots, group, scale, hd, v, ts->iota, n, out);
            continue;
        }
        size_t c = 0;
        for (size_t j = 0; j < n; j++)
            if (mask[j] && (!windowed || slot_position(seg, j) > pos - (int64_t)window)) ts->idx[c++] = (int32_t)j;
        for (size_t h = 0; h < group; h++) {
            const float *sh = sc + h * st->max_slots;
            float *ph = ts->probs + h * st->max_slots;
            for (size_t k = 0; k < c; k++) ph[k] = sh[ts->idx[k]];
            scale[h] = 1.0f / st->kern->softmax(ph, c);
        }
        st->kern->values(ts->probs, st->max_slots, group, scale, hd, v, ts->idx, c, out);
    }
}

static void residual_add(fwd_state *st, size_t c0, size_t c1) {
    const size_t d = st->m->hidden;
    for (size_t r = 0; r < st->rows; r++)
        for (size_t c = c0; c < c1; c++) st->x[r * d + c] += st->proj[r * d + c];
}

/* x[r] += RMSNorm(proj[r]) * w: a block output's norm before its residual add (gemma3). */
static void norm_residual_add(fwd_state *st, size_t r, const float *w) {
    const size_t d = st->m->hidden;
    const float *p = st->proj + r * d;
    float *x = st->x + r * d;
    const float scale = 1.0f / sqrtf(st->kern->sum_squares(p, d) / (float)d + st->m->rms_eps);
    for (size_t k = 0; k < d; k++) x[k] += p[k] * scale * w[k];
}

/* out[i] = gelu_tanh(gate[i]) * up[i] (GELU's tanh form, as llama.cpp computes it); plain C on
 * every instruction set, so every path gives the same bits. */
static void geglu(const float *gate, const float *up, size_t n, float *out) {
    const float sqrt_2_over_pi = 0.79788456080286535588f, coef = 0.044715f;
    for (size_t i = 0; i < n; i++) {
        const float x = gate[i];
        out[i] = 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * (1.0f + coef * x * x))) * up[i];
    }
}

/* tmp[r] = the gated activation of row r's gate and up halves, quantized for the down product. */
static void ffn_activate(fwd_state *st, thread_scratch *ts) {
    const llama_model *m = st->m;
    for (size_t r = 0; r < st->rows; r++) {
        const float *gate = st->gu + r * 2 * m->ffn, *up = gate + m->ffn;
        if (m->ffn_gelu) geglu(gate, up, m->ffn, ts->tmp + r * m->ffn);
        else st->kern->swiglu(gate, up, m->ffn, ts->tmp + r * m->ffn);
    }
    quantize_rows(st, ts, ts->tmp, m->ffn, m->ffn, st->rows);
}

/* Phases in order; the totals are set by set_phase_totals, consumed by forward_job. A phase
 * with no items (a step the architecture does not have) is skipped. */
enum { PH_QKV, PH_QKV_ROWS, PH_ATTN, PH_WO, PH_POST_ATTN, PH_GATE_UP, PH_DOWN, PH_POST_FFN, PH_TAPS,
       PH_PER_LAYER };

static size_t phase_count(const llama_model *m) { return 1 + m->n_layer * PH_PER_LAYER + 1; }

static void set_phase_totals(fwd_state *st) {
    const llama_model *m = st->m;
    const llama_request *req = st->req;
    phase *p = st->phases;
    const uint32_t rows = (uint32_t)st->rows;
    for (size_t i = 0; i < st->n_phases; i++) {
        atomic_init(&p[i].claimed, 0);
        atomic_init(&p[i].done, 0);
        p[i].total = 0;
    }
    p[0].total = rows;  /* embeddings */
    for (size_t l = 0; l < m->n_layer; l++) {
        const llama_layer *L = &m->layers[l];
        phase *q = p + 1 + l * PH_PER_LAYER;
        q[PH_QKV].total = matmul_items(st, L->qkv, 3);
        q[PH_QKV_ROWS].total = qkv_by_rows(m, L) ? rows : 0;
        q[PH_ATTN].total = (uint32_t)(st->n_att_blocks * m->n_kv);
        q[PH_WO].total = matmul_items(st, &L->wo, 1);
        q[PH_POST_ATTN].total = L->post_attn_norm ? rows : 0;
        q[PH_GATE_UP].total = matmul_items(st, L->gate_up, 2);
        q[PH_DOWN].total = matmul_items(st, &L->down, 1);
        q[PH_POST_FFN].total = L->post_ffn_norm ? rows : 0;
        for (size_t t = 0; t < req->n_taps; t++)
            if ((size_t)req->tap_layers[t] == l && req->taps) q[PH_TAPS].total = rows;
    }
    if (req->n_logit_rows)
        p[st->n_phases - 1].total = matmul_items(st, req->head ? req->head : &m->head, 1);
}

static void forward_job(void *arg, int tid) {
    fwd_state *st = arg;
    const llama_model *m = st->m;
    const llama_request *req = st->req;
    thread_scratch *ts = &st->ts[tid];
    const size_t rows = st->rows, d = m->hidden, nh = m->n_head * m->head_dim;
    size_t c0, c1;
    long item;

    phase *ph = st->phases, *prev = ph;
    while ((item = phase_claim(ph)) >= 0) {
        const size_t r = (size_t)item;
        const llama_segment *seg = &req->segs[st->row_seg[r]];
        float *x = st->x + r * d;
        if (req->inputs) {
            memcpy(x, req->inputs + r * d, d * sizeof(float));
        } else {
            llama_embed_row(m, seg->tokens[r - (size_t)st->row_first[r]], x);
            if (m->embed_scale != 1.0f)
                for (size_t k = 0; k < d; k++) x[k] *= m->embed_scale;
        }
        phase_finish(ph);
    }

/* Runs phase P after `prev` (when it has items), claiming its items with BODY; P becomes prev. */
#define PHASE(P, PROLOGUE, ...)                                \
    if ((P)->total) {                                          \
        if (phase_open(P)) {                                   \
            phase_wait(prev);                                  \
            PROLOGUE;                                          \
            while ((item = phase_claim(P)) >= 0) {             \
                __VA_ARGS__;                                   \
                phase_finish(P);                               \
            }                                                  \
        }                                                      \
        prev = (P);                                            \
    }

    for (size_t l = 0; l < m->n_layer; l++) {
        const llama_layer *L = &m->layers[l];
        phase *q = st->phases + 1 + l * PH_PER_LAYER;
        const int by_rows = q[PH_QKV_ROWS].total > 0;
        const int post_attn = q[PH_POST_ATTN].total > 0, post_ffn = q[PH_POST_FFN].total > 0;

        PHASE(&q[PH_QKV], norm_quantize(st, ts, st->x, rows, NULL, L->attn_norm), {
            matmul_item(st, ts, L->qkv, 3, (size_t)item, rows, st->qkv, st->n_qkv, &c0, &c1);
            if (!by_rows) qkv_epilogue(st, l, c0, c1);
        })
        PHASE(&q[PH_QKV_ROWS], (void)0, qkv_row(st, l, (size_t)item))
        PHASE(&q[PH_ATTN], (void)0, attention_item(st, ts, l, (size_t)item))
        PHASE(&q[PH_WO], quantize_rows(st, ts, st->attn, nh, nh, rows), {
            matmul_item(st, ts, &L->wo, 1, (size_t)item, rows, st->proj, d, &c0, &c1);
            if (!post_attn) residual_add(st, c0, c1);
        })
        PHASE(&q[PH_POST_ATTN], (void)0, norm_residual_add(st, (size_t)item, L->post_attn_norm))
        PHASE(&q[PH_GATE_UP], norm_quantize(st, ts, st->x, rows, NULL, L->ffn_norm),
              matmul_item(st, ts, L->gate_up, 2, (size_t)item, rows, st->gu, 2 * m->ffn, &c0, &c1))
        PHASE(&q[PH_DOWN], ffn_activate(st, ts), {
            matmul_item(st, ts, &L->down, 1, (size_t)item, rows, st->proj, d, &c0, &c1);
            if (!post_ffn) residual_add(st, c0, c1);
        })
        PHASE(&q[PH_POST_FFN], (void)0, norm_residual_add(st, (size_t)item, L->post_ffn_norm))
        PHASE(&q[PH_TAPS], (void)0, {
            for (size_t t = 0; t < req->n_taps; t++)
                if ((size_t)req->tap_layers[t] == l)
                    memcpy(req->taps + ((size_t)item * req->n_taps + t) * d, st->x + (size_t)item * d,
                           d * sizeof(float));
        })
    }
#undef PHASE

    phase *head_phase = st->phases + st->n_phases - 1;
    if (phase_open(head_phase)) {
        const llama_matrix *head = req->head ? req->head : &m->head;
        phase_wait(prev);
        norm_quantize(st, ts, st->x, req->n_logit_rows, req->logit_rows, m->out_norm);
        while ((item = phase_claim(head_phase)) >= 0) {
            matmul_item(st, ts, head, 1, (size_t)item, req->n_logit_rows, req->logits, head->n, &c0, &c1);
            phase_finish(head_phase);
        }
    }
    if (tid == 0) {  /* the caller returns only when every item of every phase is done */
        phase_wait(prev);
        phase_wait(head_phase);
    }
}

typedef struct {
    fwd_state *st;
    const float *hidden;
    size_t rows;
    const llama_matrix *head;
    float *logits;
    int norm;
} project_state;

static void project_job(void *arg, int tid) {
    project_state *ps = arg;
    thread_scratch *ts = &ps->st->ts[tid];
    phase *p = ps->st->phases;
    size_t c0, c1;
    long item;
    if (!phase_open(p)) return;
    if (ps->norm)
        norm_quantize(ps->st, ts, ps->hidden, ps->rows, NULL, ps->st->m->out_norm);
    else
        quantize_rows(ps->st, ts, ps->hidden, ps->head->k, ps->head->k, ps->rows);
    while ((item = phase_claim(p)) >= 0) {
        matmul_item(ps->st, ts, ps->head, 1, (size_t)item, ps->rows, ps->logits, ps->head->n, &c0, &c1);
        phase_finish(p);
    }
    if (tid == 0) phase_wait(p);
}

/* Lays out (and with pass 1 allocates) the shared buffers for st->rows rows and each thread's
 * scratch for qrows quantized rows; returns the block to free, or NULL. */
static char *alloc_state(fwd_state *st, int nt, size_t qrows) {
    const llama_model *m = st->m;
    const size_t hd = m->head_dim, d = m->hidden, group = m->n_head / m->n_kv, rows = st->rows;
    size_t wide = d > m->ffn ? d : m->ffn;
    if (st->k_in > wide) wide = st->k_in;
    char *mem = NULL;
    size_t off = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !(mem = aligned_alloc(64, (off + 63) / 64 * 64))) return NULL;
        off = 0;
#define TAKE(ptr, type, count) \
    (ptr = mem ? (type *)(mem + off) : NULL, off += ((count) * sizeof(type) + 63) / 64 * 64)
        TAKE(st->row_seg, int32_t, rows);
        TAKE(st->row_first, int32_t, rows);
        TAKE(st->phases, phase, st->n_phases);
        TAKE(st->att_blocks, att_block, rows);
        TAKE(st->rope, float, rows * hd);
        TAKE(st->rope_local, float, rows * hd);
        TAKE(st->x, float, rows * d);
        TAKE(st->qkv, float, rows * st->n_qkv);
        TAKE(st->attn, float, rows * m->n_head * hd);
        TAKE(st->gu, float, rows * 2 * m->ffn);
        TAKE(st->proj, float, rows * d);
        TAKE(st->ts, thread_scratch, (size_t)nt);
        for (int t = 0; t < nt; t++) {
            thread_scratch ts;
            TAKE(ts.tmp, float, qrows * wide);
            TAKE(ts.qa.q, int8_t, qrows * wide);
            TAKE(ts.qa.d, float, qrows * (wide / LLAMA_QK));
            TAKE(ts.qa.s, float, qrows * (wide / LLAMA_QK));
            TAKE(ts.qa.sum, int32_t, qrows * (wide / LLAMA_QK));
            TAKE(ts.qa.sum_lo, int32_t, qrows * (wide / LLAMA_QK));
            TAKE(ts.scores, float, ATT_ROWS * group * st->max_slots);
            TAKE(ts.probs, float, group * st->max_slots);
            TAKE(ts.idx, int32_t, st->max_slots);
            TAKE(ts.iota, int32_t, st->max_slots);
            if (pass == 1) {
                for (size_t j = 0; j < st->max_slots; j++) ts.iota[j] = (int32_t)j;
                st->ts[t] = ts;
            }
        }
#undef TAKE
    }
    return mem;
}

DSPARK_PROBE_SEMAPHORE(step_begin);
DSPARK_PROBE_SEMAPHORE(step_end);
DSPARK_PROBE_SEMAPHORE(prefill_chunk);

int llama_forward(const llama_model *m, const llama_kernels *kern, llama_pool *pool,
                  const llama_request *req) {
    fwd_state st = {0};
    st.m = m, st.kern = kern, st.req = req, st.pool = pool;
    st.n_phases = phase_count(m);
    const size_t hd = m->head_dim;
    size_t cached = 0;
    for (size_t s = 0; s < req->n_segs; s++) {
        st.rows += req->segs[s].t;
        cached += req->segs[s].length;
        const size_t width = req->segs[s].length + req->segs[s].t;
        if (width > st.max_slots) st.max_slots = width;
    }
    DSPARK_PROBE(step_begin, st.rows, cached, req->n_segs, req->n_logit_rows, kern->name);
    if (req->n_logit_rows == 0) DSPARK_PROBE(prefill_chunk, st.rows, cached);
    st.max_slots = (st.max_slots + 15) / 16 * 16;
    st.n_qkv = (m->n_head + 2 * m->n_kv) * hd;
    char *mem = alloc_state(&st, pool->n, st.rows > req->n_logit_rows ? st.rows : req->n_logit_rows);
    if (!mem) {
        DSPARK_PROBE(step_end, st.rows, -1);
        return -1;
    }
    size_t r = 0;
    for (size_t s = 0; s < req->n_segs; s++)
        for (size_t i = 0; i < req->segs[s].t; i++, r++) {
            st.row_seg[r] = (int32_t)s;
            st.row_first[r] = (int32_t)(r - i);
            if (i % ATT_ROWS == 0) {
                const size_t left = req->segs[s].t - i;
                st.att_blocks[st.n_att_blocks++] = (att_block){r, left < ATT_ROWS ? left : ATT_ROWS};
            }
            for (size_t k = 0; k < hd / 2; k++) {
                const double pos = (double)req->segs[s].positions[i], e = -2.0 * (double)k / (double)hd;
                const double factor = m->rope_factors ? (double)m->rope_factors[k] : 1.0;
                const double theta = pos * pow(m->rope_base, e) / factor;
                st.rope[r * hd + 2 * k] = (float)cos(theta);
                st.rope[r * hd + 2 * k + 1] = (float)sin(theta);
                if (m->rope_base_local > 0) {
                    const double local = pos * pow(m->rope_base_local, e) / factor;
                    st.rope_local[r * hd + 2 * k] = (float)cos(local);
                    st.rope_local[r * hd + 2 * k + 1] = (float)sin(local);
                }
            }
        }
    set_phase_totals(&st);
    pool_run(pool, forward_job, &st);
    free(mem);
    DSPARK_PROBE(step_end, st.rows, 0);
    return 0;
}

int llama_project(const llama_model *m, const llama_kernels *kern, llama_pool *pool,
                  const float *hidden, size_t rows, const llama_matrix *head, int norm,
                  float *logits) {
    fwd_state st = {0};
    st.m = m, st.kern = kern, st.pool = pool;
    st.n_phases = 1;
    st.k_in = head->k;
    char *mem = alloc_state(&st, pool->n, rows);
    if (!mem) return -1;
    project_state ps = {&st, hidden, rows, head, logits, norm};
    atomic_init(&st.phases[0].claimed, 0);
    atomic_init(&st.phases[0].done, 0);
    st.phases[0].total = matmul_items(&st, head, 1);
    pool_run(pool, project_job, &ps);
    free(mem);
    return 0;
}
