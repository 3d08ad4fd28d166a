/* The cache's private layout, shared by pc_cache.c (lifetime, checks) and pc_update.c. */
#ifndef PC_INTERNAL_H
#define PC_INTERNAL_H

#include "paired_cache.h"

#define PC_MAX_THREADS 64

/* A persistent thread pool (pc_parallel.c). pc_pool_for runs fn(ctx, begin, end) over
 * [0, n) in chunks of grain on the pool and the calling thread when n >= par_threshold,
 * otherwise on the calling thread alone; it returns when every chunk is done. */
typedef void (*pc_range_fn)(void *ctx, int64_t begin, int64_t end);
typedef struct pc_pool pc_pool;
pc_pool *pc_pool_create(int64_t num_threads);
void pc_pool_destroy(pc_pool *pool);
void pc_pool_for(pc_pool *pool, int64_t n, int64_t grain, int64_t par_threshold, pc_range_fn fn,
                 void *ctx);

/* One row copy: into packed position dst, from pool row src (from_pool) or from packed
 * position src (compaction). */
typedef struct {
    int32_t dst;
    int32_t src;
    int32_t from_pool;
} pc_copy;

struct pc_cache {
    pc_config cfg;
    size_t gate_up_row_bytes; /* (gate_cols + up_cols) * elem_size; up_cols * elem_size
                               * with skip_gate */
    size_t down_row_bytes;
    size_t pool_gate_up_offset; /* where a pool row's copied gate | up (or up) part starts */
    size_t pool_down_offset;    /* where its down_T part starts */
    size_t pool_row_bytes; /* gate_up_row_bytes + down_row_bytes rounded up to a multiple
                            * of 64 and of elem_size: every pool row on a cache line */

    uint8_t *neuron_pool;    /* [N, pool_row_bytes]: gate | up | down_T per neuron */
    int pool_is_mapped;      /* 1: neuron_pool is the caller's (a file mapping), read only */
    uint8_t *active_gate_up; /* [capacity, gate_cols + up_cols], or [capacity, up_cols] */
    uint8_t *active_down_T;  /* [capacity, hidden] */

    int32_t *active_indices;    /* [capacity], first m valid */
    int32_t *index_to_position; /* [N], -1 when absent */
    uint8_t *current_mask;      /* [N] */
    int64_t m;

    /* Scratch, sized once so that an update never allocates. */
    int32_t *added;          /* [N] */
    int32_t *removed;        /* [N] */
    int32_t *removed_pos;    /* [capacity] */
    uint8_t *position_flags; /* [capacity] */
    pc_copy *copies;         /* [capacity] */

    pc_pool *pool; /* NULL when num_threads == 1 */
    pc_stats stats;
};

#endif
