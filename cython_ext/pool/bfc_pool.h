#ifndef DSPARK_BFC_POOL_H
#define DSPARK_BFC_POOL_H
#include <stddef.h>

#define DSPARK_POOL_BEST_FIT 0
#define DSPARK_POOL_FIRST_FIT 1
#define DSPARK_POOL_ALIGN 64

typedef struct dspark_pool dspark_pool;

typedef struct {
    size_t bytes_in_use, peak_bytes_in_use, bytes_reserved, num_allocs, num_frees;
    size_t num_arenas, num_free_chunks, largest_free_block_bytes, total_free_bytes;
} dspark_pool_stats;

/* flags */
#define DSPARK_POOL_MLOCK 1     /* page-lock every arena (mlock) */
#define DSPARK_POOL_HUGEPAGE 2  /* madvise(MADV_HUGEPAGE) on every arena */
#define DSPARK_POOL_PREFAULT 4  /* touch every page of a new arena from the calling thread */

/* Returns NULL with *err set to an errno value on failure. */
dspark_pool *dspark_pool_create(int policy, size_t arena_bytes, size_t max_bytes,
                                size_t initial_bytes, int flags, int *err);
void dspark_pool_destroy(dspark_pool *p);
/* 64-byte aligned block of at least nbytes; *handle identifies it for free.
 * Returns NULL with *err = ENOMEM (limit reached, or nbytes > SIZE_MAX / 2) or an mmap/mlock errno. */
void *dspark_pool_alloc(dspark_pool *p, size_t nbytes, void **handle, int *err);
/* handle must come from dspark_pool_alloc on this pool and be freed once (not checked here). */
void dspark_pool_free(dspark_pool *p, void *handle);
void dspark_pool_get_stats(dspark_pool *p, dspark_pool_stats *s);
#endif
