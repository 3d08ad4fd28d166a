/*
 * paired-cache C core: the paired-replacement weight cache for contextually sparse MLPs.
 *
 * C11 plus POSIX threads; no C++, no Python or torch headers. The Python package binds
 * the declarations between the cdef markers through cffi (API mode); keep that block
 * free of preprocessor lines because cffi's cdef parser reads it verbatim.
 *
 * Layout (row-major, every buffer 64-byte aligned, owned by the cache except a mapped pool):
 *   neuron_pool[N, pool_row_bytes]  one row per neuron: its gate row (absent when
 *                                 gate_cols == 0), up row and down_T row (down[hidden, N]
 *                                 transposed) back to back, the row stride padded to a
 *                                 multiple of 64 bytes (and of elem_size)
 *   active_gate_up[capacity, gate_cols + up_cols]   gate row then up row, interleaved; with
 *                                 skip_gate, [capacity, up_cols]: the up rows only
 *   active_down_T[capacity, hidden]
 *   active_indices[capacity]      row id at each packed position
 *   index_to_position[N]          position of each row id, -1 when absent
 *   current_mask[N]               1 for active row ids
 * Rows are copied byte-wise, so any element type of elem_size bytes works. A neuron's
 * weights are one contiguous pool row, so adding it reads one run of bytes instead of
 * three rows at unrelated places.
 */
#ifndef PAIRED_CACHE_H
#define PAIRED_CACHE_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
typedef struct pc_cache pc_cache;

typedef struct {
    int64_t n_rows;        /* N: neurons, rows of the pool */
    int64_t gate_cols;     /* 0 when the MLP has no gate */
    int64_t up_cols;
    int64_t hidden;        /* columns of down transposed (down_T) */
    int64_t elem_size;     /* bytes per element: 4 float32, 2 float16/bfloat16 */
    int64_t capacity;      /* most rows active at once */
    double hybrid_tau;     /* rebuild when |A| + |R| > hybrid_tau * (m_old + m_new) / 2 */
    int64_t grain;         /* rows per parallel chunk */
    int64_t par_threshold; /* fewer rows than this are copied by the calling thread */
    int64_t num_threads;   /* threads for row copies, the caller included; >= 1 */
    int64_t skip_gate;     /* 1: the active buffers leave the gate rows in the pool (for a
                            * caller that computes the gate from the pool itself); needs
                            * gate_cols >= 1. 0: they hold gate | up per row */
} pc_config;

typedef struct {
    int64_t updates;
    int64_t paired_updates;
    int64_t rebuilds;
    int64_t rows_copied;
    int64_t bytes_moved;
    int64_t last_rows_copied; /* of the most recent update */
    int64_t last_added;
    int64_t last_removed;
    int last_was_rebuild;
} pc_stats;

enum {
    PC_OK = 0,
    PC_ERR_CONFIG = 1,   /* a pc_config field is out of range */
    PC_ERR_NOMEM = 2,
    PC_ERR_CAPACITY = 3, /* the new mask has more rows than capacity; nothing changed */
    PC_ERR_INVALID = 4   /* pc_check_valid found a broken invariant */
};

int pc_create(const pc_config *config, pc_cache **out);
/* A cache whose neuron pool is the caller's: n_rows rows of pc_pool_row_stride(...) bytes
 * at neuron_pool (64-byte aligned, else PC_ERR_CONFIG), typically a read-only file mapping.
 * The core only reads it (row copies, pc_check_valid), never writes or frees it; it must
 * outlive the cache. The active buffers and metadata are allocated as in pc_create. */
int pc_create_mapped(const pc_config *config, const void *neuron_pool, pc_cache **out);
void pc_destroy(pc_cache *cache);
/* The pool row stride pc_create would use for these columns, or -1 when out of range. */
int64_t pc_pool_row_stride(int64_t gate_cols, int64_t up_cols, int64_t hidden,
                           int64_t elem_size);

void *pc_neuron_pool(pc_cache *cache);
int64_t pc_pool_row_bytes(const pc_cache *cache); /* stride of neuron_pool's rows */
int pc_pool_is_mapped(const pc_cache *cache);      /* 1 after pc_create_mapped */
void *pc_active_gate_up(pc_cache *cache);
void *pc_active_down_T(pc_cache *cache);
int32_t *pc_active_indices(pc_cache *cache);
int32_t *pc_index_to_position(pc_cache *cache);
uint8_t *pc_current_mask(pc_cache *cache);
int64_t pc_num_active(const pc_cache *cache);

int pc_update(pc_cache *cache, const uint8_t *new_mask, int64_t *out_new_count);
int pc_check_valid(const pc_cache *cache, char *message, size_t message_len);
void pc_get_stats(const pc_cache *cache, pc_stats *out);
const char *pc_core_info(void);
/* The in-place sparse MLP of one token, float32 pools only (pc_rows.c):
 *   out[hidden] = sum over k < m of g[k] * dot(x, up(idx[k])) * down_T(idx[k])
 * with up and down_T read from the pool rows where they lie (no active buffers). x:
 * [up_cols]; g: [m], act(gate x) at the rows idx; idx: [m] row ids in [0, N), any order
 * (ascending reads the mapping forward); out: [hidden], overwritten. PC_ERR_CONFIG unless
 * elem_size is 4 (or a pointer is NULL), PC_ERR_INVALID for a row id out of range: both
 * before out is written. Runs on the calling thread. */
int pc_rows_mlp_f32(const pc_cache *cache, const float *x, const float *g, const int32_t *idx,
                    int64_t m, float *out);
/* The same over up [n_rows, up_cols] and down_T [n_rows, hidden], two row-major float32
 * arrays (rows decoded from a compressed pool, or kept decoded): the same products in the
 * same order as pc_rows_mlp_f32 over a pool holding those rows. PC_ERR_CONFIG for a bad
 * size or a NULL pointer, PC_ERR_INVALID for a row id outside [0, n_rows): both before out
 * is written. */
int pc_rows_mlp_split_f32(const float *x, const float *g, const int32_t *idx, int64_t m,
                          const float *up, const float *down_T, int64_t n_rows, int64_t up_cols,
                          int64_t hidden, float *out);
/* The same over rows of a grid pool (grid_pool.py), decoded one at a time as they are
 * multiplied: no rows are copied out. Row r's record (record_bytes at records + r *
 * record_bytes) holds its up codes (up_bits 4: two per byte, the even one in the low nibble;
 * 8: int8), the float16 d of each block of PC_GRID_BLOCK up values (then m, up_affine), then
 * its down_T codes (down_bits); down_T's float16 d (and m, or NULL) are rows of the
 * layer's tables [n_rows / PC_GRID_BLOCK, hidden], row r // PC_GRID_BLOCK. Each value is
 * d * q (+ m), two float32 roundings, and the products are those of pc_rows_mlp_split_f32
 * over the decoded rows, in the same order. idx: [m] int64 row ids in [0, n_rows); row:
 * [up_cols + hidden] floats of workspace; out: [hidden], overwritten. PC_ERR_CONFIG for bad
 * sizes, kinds or a NULL pointer, PC_ERR_INVALID for a row id out of range: both before out
 * is written. */
#define PC_GRID_BLOCK 32
int pc_grid_rows_mlp_f32(const float *x, const float *g, const int64_t *idx, int64_t m,
                         const uint8_t *records, int64_t record_bytes, int64_t n_rows,
                         int up_bits, int up_affine, int64_t up_cols, int down_bits,
                         const uint16_t *down_d, const uint16_t *down_m, int64_t hidden,
                         float *row, float *out);
/* One token's rows for a gated MLP (pc_select.c): the k of n rows with the largest
 *   score_i = |g[i]| * E|u_i|, u_i ~ Normal(up_mean[i], up_sd[i]^2)
 * (score_i = |g[i]| when up_mean and up_sd are both NULL), ties to the lowest ids, NaN
 * above +inf. Writes their ids ascending to idx[k] and g at them to g_at[k]. g: [n], act(gate x).
 * PC_ERR_CONFIG for a NULL output, k outside [1, n] or only one of up_mean, up_sd;
 * PC_ERR_NOMEM when its n-key workspace cannot be allocated; nothing is written then. */
int pc_select_gated_f32(const float *g, const float *up_mean, const float *up_sd, int64_t n,
                        int64_t k, int32_t *idx, float *g_at);
/* out[i] = E|u_i|, u_i ~ Normal(mean[i], sd[i]^2), as pc_select_gated_f32 scores it
 * (polynomial exp and erf, relative error below 5e-7; |mean| where sd is not > 0). */
void pc_expected_abs_f32(const float *mean, const float *sd, int64_t n, float *out);
/* cdef-end */

void *pc_aligned_alloc(size_t bytes);
void pc_aligned_free(void *ptr);

#endif
