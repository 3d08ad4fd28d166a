/*
 * A small persistent pool of POSIX threads for the cache's row copies.
 *
 * pthreads, not OpenMP: the extension lives in the same process as torch, and a second
 * OpenMP runtime beside torch's can crash or oversubscribe. Workers sleep on a condition
 * variable between updates. Chunks are claimed from one atomic word that carries the job's
 * generation in its high half, so a worker that wakes late can never claim a chunk of a
 * newer job with an older job's arguments, and the caller never waits for a worker that
 * has not started: it runs every unclaimed chunk itself and waits only for chunks in flight.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pc_internal.h"

struct pc_pool {
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    uint32_t generation; /* guarded by mutex */
    int stop;            /* guarded by mutex */
    pc_range_fn fn;      /* the current job, guarded by mutex */
    void *ctx;
    int64_t n;
    int64_t grain;
    int64_t chunks;
    atomic_ullong claim; /* (generation << 32) | next chunk */
    atomic_llong done;   /* chunks of the current job finished */
    int64_t started;
    pthread_t threads[PC_MAX_THREADS];
};

/* Claims the next chunk of job `generation`; -1 once that job has no chunk left. */
static int64_t claim_chunk(pc_pool *pool, uint32_t generation, int64_t chunks) {
    unsigned long long v = atomic_load(&pool->claim);
    for (;;) {
        if ((uint32_t)(v >> 32) != generation || (int64_t)(v & 0xFFFFFFFFull) >= chunks) {
            return -1;
        }
        if (atomic_compare_exchange_weak(&pool->claim, &v, v + 1)) {
            return (int64_t)(v & 0xFFFFFFFFull);
        }
    }
}

static void run_job(pc_pool *pool, uint32_t generation, pc_range_fn fn, void *ctx, int64_t n,
                    int64_t grain, int64_t chunks) {
    int64_t chunk;
    while ((chunk = claim_chunk(pool, generation, chunks)) >= 0) {
        int64_t begin = chunk * grain;
        int64_t end = begin + grain < n ? begin + grain : n;
        fn(ctx, begin, end);
        atomic_fetch_add(&pool->done, 1);
    }
}

static void *worker(void *arg) {
    pc_pool *pool = arg;
    uint32_t seen = 0;
    pthread_mutex_lock(&pool->mutex);
    for (;;) {
        while (!pool->stop && pool->generation == seen) {
            pthread_cond_wait(&pool->wake, &pool->mutex);
        }
        if (pool->stop) {
            break;
        }
        seen = pool->generation;
        pc_range_fn fn = pool->fn;
        void *ctx = pool->ctx;
        int64_t n = pool->n, grain = pool->grain, chunks = pool->chunks;
        pthread_mutex_unlock(&pool->mutex);
        run_job(pool, seen, fn, ctx, n, grain, chunks);
        pthread_mutex_lock(&pool->mutex);
    }
    pthread_mutex_unlock(&pool->mutex);
    return NULL;
}

pc_pool *pc_pool_create(int64_t num_threads) {
    pc_pool *pool = calloc(1, sizeof(*pool));
    if (pool == NULL) {
        return NULL;
    }
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    atomic_init(&pool->claim, 0);
    atomic_init(&pool->done, 0);
    for (int64_t t = 1; t < num_threads && t < PC_MAX_THREADS; t++) {
        /* A thread that cannot start leaves its share to the others: slower, still correct. */
        if (pthread_create(&pool->threads[pool->started], NULL, worker, pool) != 0) {
            break;
        }
        pool->started++;
    }
    return pool;
}

void pc_pool_destroy(pc_pool *pool) {
    if (pool == NULL) {
        return;
    }
    pthread_mutex_lock(&pool->mutex);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int64_t t = 0; t < pool->started; t++) {
        pthread_join(pool->threads[t], NULL);
    }
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mutex);
    free(pool);
}

void pc_pool_for(pc_pool *pool, int64_t n, int64_t grain, int64_t par_threshold, pc_range_fn fn,
                 void *ctx) {
    if (n <= 0) {
        return;
    }
    if (grain < 1) {
        grain = 1;
    }
    int64_t chunks = (n + grain - 1) / grain;
    if (pool == NULL || pool->started == 0 || n < par_threshold || chunks < 2 ||
        chunks > 0xFFFFFFFFll) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool->mutex);
    uint32_t generation = ++pool->generation;
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n = n;
    pool->grain = grain;
    pool->chunks = chunks;
    atomic_store(&pool->done, 0);
    atomic_store(&pool->claim, (unsigned long long)generation << 32);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    run_job(pool, generation, fn, ctx, n, grain, chunks);
    /* Every chunk is claimed now; wait only for the ones other threads are still copying. */
    while (atomic_load(&pool->done) < chunks) {
        sched_yield();
    }
}
