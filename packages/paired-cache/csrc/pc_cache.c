/* Lifetime, accessors, invariant checks and statistics of the paired-replacement cache. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* madvise and MADV_HUGEPAGE on glibc and musl */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "pc_internal.h"

#ifndef PC_SOURCE_DIGEST
#define PC_SOURCE_DIGEST "unknown"
#endif
#define PC_STR2(x) #x
#define PC_STR(x) PC_STR2(x)

#define PC_ALIGN 64
#define PC_HUGE_PAGE ((size_t)2 << 20)

void *pc_aligned_alloc(size_t bytes) {
    /* Buffers of a huge page or more (the pools, the active rows) are huge-page aligned and
     * asked for transparent huge pages: an update reads rows at random places in pools far
     * larger than the TLB covers with 4 KiB pages, and a page walk per row is what made the
     * gathers slower than memcpy. The advice must come before the first touch (the memset);
     * it is only a hint, so a kernel that declines it leaves a slower, still correct cache. */
    size_t align = bytes >= PC_HUGE_PAGE ? PC_HUGE_PAGE : PC_ALIGN;
    /* aligned_alloc wants a multiple of the alignment; a zero-byte buffer still gets one line
     * so that every pointer the cache hands out is valid and distinct. */
    size_t rounded = bytes == 0 ? align : (bytes + align - 1) / align * align;
    void *ptr = aligned_alloc(align, rounded);
    if (ptr == NULL) {
        return NULL;
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == PC_HUGE_PAGE) {
        (void)madvise(ptr, rounded, MADV_HUGEPAGE);
    }
#endif
    memset(ptr, 0, rounded);
    return ptr;
}

void pc_aligned_free(void *ptr) { free(ptr); }

/* a * b * c bytes, or 0 with *overflow set when it does not fit in size_t. */
static size_t mul3(int64_t a, int64_t b, int64_t c, int *overflow) {
    size_t r = (size_t)a;
    if (b != 0 && r > SIZE_MAX / (size_t)b) {
        *overflow = 1;
        return 0;
    }
    r *= (size_t)b;
    if (c != 0 && r > SIZE_MAX / (size_t)c) {
        *overflow = 1;
        return 0;
    }
    return r * (size_t)c;
}

static int config_ok(const pc_config *c) {
    return c->n_rows >= 1 && c->n_rows <= INT32_MAX && c->gate_cols >= 0 &&
           c->gate_cols <= INT32_MAX && c->up_cols >= 1 && c->up_cols <= INT32_MAX &&
           c->hidden >= 1 && c->hidden <= INT32_MAX && c->elem_size >= 1 && c->elem_size <= 16 && c->capacity >= 1 &&
           c->capacity <= c->n_rows && !isnan(c->hybrid_tau) && c->hybrid_tau >= 0.0 &&
           c->grain >= 1 && c->par_threshold >= 0 && c->num_threads >= 1 &&
           c->num_threads <= PC_MAX_THREADS && (c->skip_gate == 0 || c->skip_gate == 1) &&
           (c->skip_gate == 0 || c->gate_cols >= 1);
}

/* Bytes from one neuron's pool row to the next: its gate, up and down_T rows rounded up to a
 * multiple of the cache line and of the element size, so that every row starts on a line
 * and the strided torch views of the pool count their stride in whole elements. */
static size_t pool_row_stride(size_t row_bytes, size_t elem_size) {
    size_t a = PC_ALIGN, b = elem_size;
    while (b != 0) {
        size_t t = a % b;
        a = b;
        b = t;
    }
    size_t unit = PC_ALIGN / a * elem_size; /* lcm(PC_ALIGN, elem_size) */
    return (row_bytes + unit - 1) / unit * unit;
}

int64_t pc_pool_row_stride(int64_t gate_cols, int64_t up_cols, int64_t hidden,
                           int64_t elem_size) {
    if (gate_cols < 0 || gate_cols > INT32_MAX || up_cols < 1 || up_cols > INT32_MAX ||
        hidden < 1 || hidden > INT32_MAX || elem_size < 1 || elem_size > 16) {
        return -1;
    }
    int overflow = 0;
    size_t row_bytes = mul3(gate_cols + up_cols + hidden, elem_size, 1, &overflow);
    size_t stride = pool_row_stride(row_bytes, (size_t)elem_size);
    if (overflow || stride < row_bytes || stride > (size_t)INT64_MAX) {
        return -1;
    }
    return (int64_t)stride;
}

/* pc_create and pc_create_mapped: the pool is allocated here when mapped_pool is NULL,
 * otherwise the caller's N rows of pool_row_bytes are read in place and never written. */
static int create(const pc_config *config, const void *mapped_pool, pc_cache **out) {
    *out = NULL;
    if (config == NULL || !config_ok(config)) {
        return PC_ERR_CONFIG;
    }
    int overflow = 0;
    const pc_config *c = config;
    /* The column counts are at most INT32_MAX each and elem_size at most 16, so their sum
     * and the row's bytes fit in int64_t; the stride can only wrap a 32-bit size_t. */
    size_t row_bytes = mul3(c->gate_cols + c->up_cols + c->hidden, c->elem_size, 1, &overflow);
    size_t row_stride = pool_row_stride(row_bytes, (size_t)c->elem_size);
    overflow |= row_stride < row_bytes;
    size_t pool_bytes = mul3(c->n_rows, (int64_t)row_stride, 1, &overflow);
    int64_t active_gate_cols = c->skip_gate ? 0 : c->gate_cols;
    size_t gate_up_bytes =
        mul3(c->capacity, active_gate_cols + c->up_cols, c->elem_size, &overflow);
    size_t down_bytes = mul3(c->capacity, c->hidden, c->elem_size, &overflow);
    if (overflow) {
        return PC_ERR_CONFIG;
    }
    pc_cache *cache = calloc(1, sizeof(*cache));
    if (cache == NULL) {
        return PC_ERR_NOMEM;
    }
    cache->cfg = *c;
    cache->gate_up_row_bytes = (size_t)((active_gate_cols + c->up_cols) * c->elem_size);
    cache->down_row_bytes = (size_t)(c->hidden * c->elem_size);
    cache->pool_gate_up_offset = (size_t)((c->gate_cols - active_gate_cols) * c->elem_size);
    cache->pool_down_offset = (size_t)((c->gate_cols + c->up_cols) * c->elem_size);
    cache->pool_row_bytes = row_stride;
    size_t n = (size_t)c->n_rows;
    size_t cap = (size_t)c->capacity;

    /* A mapped pool is only ever read (memcpy sources, check_valid's memcmp): the cast
     * drops const for the shared field, never to write through it. */
    cache->pool_is_mapped = mapped_pool != NULL;
    cache->neuron_pool =
        mapped_pool != NULL ? (uint8_t *)(uintptr_t)mapped_pool : pc_aligned_alloc(pool_bytes);
    cache->active_gate_up = pc_aligned_alloc(gate_up_bytes);
    cache->active_down_T = pc_aligned_alloc(down_bytes);
    cache->active_indices = pc_aligned_alloc(cap * sizeof(int32_t));
    cache->index_to_position = pc_aligned_alloc(n * sizeof(int32_t));
    cache->current_mask = pc_aligned_alloc(n);
    cache->added = pc_aligned_alloc(n * sizeof(int32_t));
    cache->removed = pc_aligned_alloc(n * sizeof(int32_t));
    cache->removed_pos = pc_aligned_alloc(cap * sizeof(int32_t));
    cache->position_flags = pc_aligned_alloc(cap);
    cache->copies = pc_aligned_alloc(cap * sizeof(pc_copy));
    if (cache->neuron_pool == NULL || cache->active_gate_up == NULL ||
        cache->active_down_T == NULL || cache->active_indices == NULL ||
        cache->index_to_position == NULL || cache->current_mask == NULL ||
        cache->added == NULL || cache->removed == NULL || cache->removed_pos == NULL ||
        cache->position_flags == NULL || cache->copies == NULL ||
        (c->num_threads > 1 && (cache->pool = pc_pool_create(c->num_threads)) == NULL)) {
        pc_destroy(cache);
        return PC_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        cache->index_to_position[i] = -1;
    }
    *out = cache;
    return PC_OK;
}

int pc_create(const pc_config *config, pc_cache **out) { return create(config, NULL, out); }

int pc_create_mapped(const pc_config *config, const void *neuron_pool, pc_cache **out) {
    if (neuron_pool == NULL || (uintptr_t)neuron_pool % PC_ALIGN != 0) {
        *out = NULL;
        return PC_ERR_CONFIG;
    }
    return create(config, neuron_pool, out);
}

void pc_destroy(pc_cache *cache) {
    if (cache == NULL) {
        return;
    }
    pc_pool_destroy(cache->pool);
    if (!cache->pool_is_mapped) {
        pc_aligned_free(cache->neuron_pool);
    }
    pc_aligned_free(cache->active_gate_up);
    pc_aligned_free(cache->active_down_T);
    pc_aligned_free(cache->active_indices);
    pc_aligned_free(cache->index_to_position);
    pc_aligned_free(cache->current_mask);
    pc_aligned_free(cache->added);
    pc_aligned_free(cache->removed);
    pc_aligned_free(cache->removed_pos);
    pc_aligned_free(cache->position_flags);
    pc_aligned_free(cache->copies);
    free(cache);
}

void *pc_neuron_pool(pc_cache *cache) { return cache->neuron_pool; }
int64_t pc_pool_row_bytes(const pc_cache *cache) { return (int64_t)cache->pool_row_bytes; }
int pc_pool_is_mapped(const pc_cache *cache) { return cache->pool_is_mapped; }
void *pc_active_gate_up(pc_cache *cache) { return cache->active_gate_up; }
void *pc_active_down_T(pc_cache *cache) { return cache->active_down_T; }
int32_t *pc_active_indices(pc_cache *cache) { return cache->active_indices; }
int32_t *pc_index_to_position(pc_cache *cache) { return cache->index_to_position; }
uint8_t *pc_current_mask(pc_cache *cache) { return cache->current_mask; }
int64_t pc_num_active(const pc_cache *cache) { return cache->m; }

void pc_get_stats(const pc_cache *cache, pc_stats *out) { *out = cache->stats; }

const char *pc_core_info(void) {
    return "paired-cache C core; C" PC_STR(__STDC_VERSION__) "; pthreads; source sha256 "
        PC_SOURCE_DIGEST;
}

#define FAIL(...)                                         \
    do {                                                  \
        if (message != NULL && message_len > 0) {         \
            snprintf(message, message_len, __VA_ARGS__);  \
        }                                                 \
        return PC_ERR_INVALID;                            \
    } while (0)

int pc_check_valid(const pc_cache *cache, char *message, size_t message_len) {
    const pc_config *c = &cache->cfg;
    if (message != NULL && message_len > 0) {
        message[0] = '\0';
    }
    if (cache->m < 0 || cache->m > c->capacity) {
        FAIL("m=%lld outside [0, capacity=%lld]", (long long)cache->m, (long long)c->capacity);
    }
    for (int64_t p = 0; p < cache->m; p++) {
        int32_t id = cache->active_indices[p];
        if (id < 0 || id >= c->n_rows) {
            FAIL("active_indices[%lld]=%d outside [0, N=%lld)", (long long)p, id,
                 (long long)c->n_rows);
        }
        if (cache->index_to_position[id] != p) {
            FAIL("index_to_position[%d]=%d but active_indices[%lld]=%d", id,
                 cache->index_to_position[id], (long long)p, id);
        }
        if (!cache->current_mask[id]) {
            FAIL("row %d is active at position %lld but absent from current_mask", id,
                 (long long)p);
        }
        const uint8_t *gate_up = cache->active_gate_up + (size_t)p * cache->gate_up_row_bytes;
        const uint8_t *down = cache->active_down_T + (size_t)p * cache->down_row_bytes;
        const uint8_t *row = cache->neuron_pool + (size_t)id * cache->pool_row_bytes;
        if (memcmp(gate_up, row + cache->pool_gate_up_offset, cache->gate_up_row_bytes) != 0 ||
            memcmp(down, row + cache->pool_down_offset, cache->down_row_bytes) != 0) {
            FAIL("active row at position %lld differs from pool row %d", (long long)p, id);
        }
    }
    int64_t in_mask = 0;
    for (int64_t id = 0; id < c->n_rows; id++) {
        int32_t pos = cache->index_to_position[id];
        in_mask += cache->current_mask[id] != 0;
        if (cache->current_mask[id] > 1) {
            FAIL("current_mask[%lld]=%d is not 0 or 1", (long long)id, cache->current_mask[id]);
        }
        if (pos == -1) {
            if (cache->current_mask[id]) {
                FAIL("row %lld is in current_mask but has no position", (long long)id);
            }
        } else if (pos < 0 || pos >= cache->m || cache->active_indices[pos] != id) {
            FAIL("index_to_position[%lld]=%d does not point back to it (m=%lld)",
                 (long long)id, pos, (long long)cache->m);
        }
    }
    if (in_mask != cache->m) {
        FAIL("current_mask has %lld rows but m=%lld", (long long)in_mask, (long long)cache->m);
    }
    return PC_OK;
}
