/* Best-fit-with-coalescing memory pool (the BFC design) over mmap'ed arenas,
 * plus a first-fit policy over the same chunks as a baseline.
 *
 * Chunks tile each arena in address order (prev/next neighbours). Free chunks
 * sit in power-of-two size-class bins, each sorted by (size, address), so the
 * first fitting chunk found is the best fit. A chunk is split only when the
 * remainder is at least MIN_SPLIT bytes; a freed chunk always merges with free
 * neighbours. One mutex guards everything. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "bfc_pool.h"
#include "dspark_probes.h"

DSPARK_PROBE_SEMAPHORE(pool_alloc);
DSPARK_PROBE_SEMAPHORE(pool_free);
DSPARK_PROBE_SEMAPHORE(pool_grow);

#define NBINS 40
#define MIN_SPLIT 256
#define HUGE_PAGE (2u << 20)
/* Larger requests are refused (ENOMEM) before any rounding, which could otherwise wrap to 0. */
#define MAX_REQUEST (SIZE_MAX >> 1)

typedef struct chunk {
    char *ptr;
    size_t size;
    int in_use;
    struct chunk *prev, *next;         /* address neighbours in the arena */
    struct chunk *bin_prev, *bin_next; /* free-bin links (best-fit) */
} chunk;

typedef struct {
    char *map;        /* what mmap returned (for munmap) */
    size_t map_size;
    chunk *first;     /* lowest-address chunk */
} arena;

struct dspark_pool {
    pthread_mutex_t mu;
    int policy, flags;
    size_t arena_bytes, max_bytes;
    arena *arenas;
    size_t n_arenas, cap_arenas;
    chunk *bins[NBINS];
    chunk *spare;     /* recycled chunk records */
    dspark_pool_stats st;
};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static int bin_of(size_t size) {
    const size_t units = size / DSPARK_POOL_ALIGN;
    int b = 63 - __builtin_clzll(units ? units : 1);
    return b < NBINS ? b : NBINS - 1;
}

static chunk *new_chunk(dspark_pool *p) {
    chunk *c = p->spare;
    if (c) p->spare = c->bin_next;
    else c = malloc(sizeof(chunk));
    if (c) memset(c, 0, sizeof(*c));
    return c;
}

static void drop_chunk(dspark_pool *p, chunk *c) {
    c->bin_next = p->spare;
    p->spare = c;
}

static void bin_insert(dspark_pool *p, chunk *c) {
    if (p->policy != DSPARK_POOL_BEST_FIT) return;
    chunk **head = &p->bins[bin_of(c->size)];
    chunk *prev = NULL, *cur = *head;
    while (cur && (cur->size < c->size || (cur->size == c->size && cur->ptr < c->ptr))) {
        prev = cur;
        cur = cur->bin_next;
    }
    c->bin_prev = prev;
    c->bin_next = cur;
    if (cur) cur->bin_prev = c;
    if (prev) prev->bin_next = c;
    else *head = c;
}

static void bin_remove(dspark_pool *p, chunk *c) {
    if (p->policy != DSPARK_POOL_BEST_FIT) return;
    if (c->bin_prev) c->bin_prev->bin_next = c->bin_next;
    else p->bins[bin_of(c->size)] = c->bin_next;
    if (c->bin_next) c->bin_next->bin_prev = c->bin_prev;
    c->bin_prev = c->bin_next = NULL;
}

/* A new arena of at least min_bytes: arena_bytes when growing, exactly min_bytes at creation. */
/* The largest free chunk (fragmentation: free bytes that are not in it), walked only while traced. */
static size_t largest_free(const dspark_pool *p) {
    size_t largest = 0;
    for (size_t a = 0; a < p->n_arenas; a++)
        for (const chunk *c = p->arenas[a].first; c; c = c->next)
            if (!c->in_use && c->size > largest) largest = c->size;
    return largest;
}

static int add_arena(dspark_pool *p, size_t min_bytes, int exact) {
    if (min_bytes > MAX_REQUEST) return ENOMEM;
    size_t size = round_up(exact || min_bytes > p->arena_bytes ? min_bytes : p->arena_bytes, HUGE_PAGE);
    if (p->max_bytes && p->st.bytes_reserved + size > p->max_bytes) {
        if (p->st.bytes_reserved + round_up(min_bytes, HUGE_PAGE) > p->max_bytes) return ENOMEM;
        size = p->max_bytes - p->st.bytes_reserved;
    }
    if (p->n_arenas == p->cap_arenas) {
        size_t cap = p->cap_arenas ? 2 * p->cap_arenas : 8;
        arena *a = realloc(p->arenas, cap * sizeof(arena));
        if (!a) return ENOMEM;
        p->arenas = a;
        p->cap_arenas = cap;
    }
    /* Over-map by one huge page so the arena can start on a 2 MiB boundary. */
    const size_t map_size = size + HUGE_PAGE;
    char *map = mmap(NULL, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return errno;
    char *base = (char *)round_up((uintptr_t)map, HUGE_PAGE);
    if (p->flags & DSPARK_POOL_HUGEPAGE) madvise(base, size, MADV_HUGEPAGE);
    if (p->flags & DSPARK_POOL_MLOCK) {
        if (mlock(base, size) != 0) {
            const int e = errno;
            munmap(map, map_size);
            return e;
        }
    }
    if (p->flags & DSPARK_POOL_PREFAULT) memset(base, 0, size);
    chunk *c = new_chunk(p);
    if (!c) {
        munmap(map, map_size);
        return ENOMEM;
    }
    c->ptr = base;
    c->size = size;
    p->arenas[p->n_arenas++] = (arena){map, map_size, c};
    p->st.bytes_reserved += size;
    p->st.num_arenas = p->n_arenas;
    bin_insert(p, c);
    DSPARK_PROBE(pool_grow, size, p->st.bytes_reserved, p->n_arenas);
    return 0;
}

static chunk *find_best_fit(dspark_pool *p, size_t size) {
    for (int b = bin_of(size); b < NBINS; b++)
        for (chunk *c = p->bins[b]; c; c = c->bin_next)
            if (c->size >= size) return c;
    return NULL;
}

static chunk *find_first_fit(dspark_pool *p, size_t size) {
    for (size_t a = 0; a < p->n_arenas; a++)
        for (chunk *c = p->arenas[a].first; c; c = c->next)
            if (!c->in_use && c->size >= size) return c;
    return NULL;
}

dspark_pool *dspark_pool_create(int policy, size_t arena_bytes, size_t max_bytes,
                                size_t initial_bytes, int flags, int *err) {
    dspark_pool *p = calloc(1, sizeof(*p));
    if (!p) {
        *err = ENOMEM;
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    p->policy = policy;
    p->flags = flags;
    p->arena_bytes = arena_bytes && arena_bytes <= MAX_REQUEST ? arena_bytes : (64u << 20);
    p->max_bytes = max_bytes;
    if (initial_bytes) {
        const int e = add_arena(p, initial_bytes, 1);
        if (e) {
            dspark_pool_destroy(p);
            *err = e;
            return NULL;
        }
    }
    return p;
}

void dspark_pool_destroy(dspark_pool *p) {
    if (!p) return;
    for (size_t a = 0; a < p->n_arenas; a++) {
        chunk *c = p->arenas[a].first;
        while (c) {
            chunk *n = c->next;
            free(c);
            c = n;
        }
        if (p->flags & DSPARK_POOL_MLOCK) munlock(p->arenas[a].map, p->arenas[a].map_size);
        munmap(p->arenas[a].map, p->arenas[a].map_size);
    }
    while (p->spare) {
        chunk *n = p->spare->bin_next;
        free(p->spare);
        p->spare = n;
    }
    free(p->arenas);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

void *dspark_pool_alloc(dspark_pool *p, size_t nbytes, void **handle, int *err) {
    if (nbytes > MAX_REQUEST) {
        *err = ENOMEM;
        return NULL;
    }
    const size_t size = round_up(nbytes ? nbytes : 1, DSPARK_POOL_ALIGN);
    pthread_mutex_lock(&p->mu);
    chunk *c = p->policy == DSPARK_POOL_BEST_FIT ? find_best_fit(p, size) : find_first_fit(p, size);
    if (!c) {
        const int e = add_arena(p, size, 0);
        if (e) {
            pthread_mutex_unlock(&p->mu);
            *err = e;
            return NULL;
        }
        c = p->policy == DSPARK_POOL_BEST_FIT ? find_best_fit(p, size) : find_first_fit(p, size);
    }
    bin_remove(p, c);
    const size_t min_split = p->policy == DSPARK_POOL_BEST_FIT ? MIN_SPLIT : DSPARK_POOL_ALIGN;
    if (c->size - size >= min_split) {
        chunk *rest = new_chunk(p);
        if (rest) {
            rest->ptr = c->ptr + size;
            rest->size = c->size - size;
            rest->prev = c;
            rest->next = c->next;
            if (c->next) c->next->prev = rest;
            c->next = rest;
            c->size = size;
            bin_insert(p, rest);
        }
    }
    c->in_use = 1;
    p->st.bytes_in_use += c->size;
    if (p->st.bytes_in_use > p->st.peak_bytes_in_use) p->st.peak_bytes_in_use = p->st.bytes_in_use;
    p->st.num_allocs++;
    DSPARK_PROBE(pool_alloc, nbytes, c->size, p->st.bytes_in_use, p->st.bytes_reserved, largest_free(p));
    pthread_mutex_unlock(&p->mu);
    *handle = c;
    return c->ptr;
}

void dspark_pool_free(dspark_pool *p, void *handle) {
    chunk *c = handle;
    pthread_mutex_lock(&p->mu);
    c->in_use = 0;
    const size_t freed = c->size;
    p->st.bytes_in_use -= c->size;
    p->st.num_frees++;
    chunk *n = c->next;
    if (n && !n->in_use) { /* absorb the free right neighbour */
        bin_remove(p, n);
        c->size += n->size;
        c->next = n->next;
        if (n->next) n->next->prev = c;
        drop_chunk(p, n);
    }
    chunk *pv = c->prev;
    if (pv && !pv->in_use) { /* let the free left neighbour absorb this one */
        bin_remove(p, pv);
        pv->size += c->size;
        pv->next = c->next;
        if (c->next) c->next->prev = pv;
        drop_chunk(p, c);
        c = pv;
    }
    bin_insert(p, c);
    DSPARK_PROBE(pool_free, freed, p->st.bytes_in_use, p->st.bytes_reserved, largest_free(p));
    pthread_mutex_unlock(&p->mu);
}

void dspark_pool_get_stats(dspark_pool *p, dspark_pool_stats *s) {
    pthread_mutex_lock(&p->mu);
    *s = p->st;
    s->largest_free_block_bytes = s->total_free_bytes = s->num_free_chunks = 0;
    for (size_t a = 0; a < p->n_arenas; a++)
        for (chunk *c = p->arenas[a].first; c; c = c->next)
            if (!c->in_use) {
                s->num_free_chunks++;
                s->total_free_bytes += c->size;
                if (c->size > s->largest_free_block_bytes) s->largest_free_block_bytes = c->size;
            }
    pthread_mutex_unlock(&p->mu);
}
