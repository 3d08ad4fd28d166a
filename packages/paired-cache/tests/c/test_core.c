/*
 * The C core's own test driver, run under valgrind memcheck by memcheck.sh.
 *
 * Random masks (empty, full, unchanged, capacity edge, small and large diffs) against a
 * plain array model; pc_check_valid and the model after every update; every error path.
 * Pool rows hold distinct bytes per row and column, computed again here for every active
 * row, so a row copied from the wrong place, or a pool layout other than gate | up | down_T
 * per neuron, is caught without trusting the core's own check.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paired_cache.h"

static int failures = 0;

#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (!(cond)) {                                    \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                 \
            fprintf(stderr, "\n");                        \
            failures++;                                   \
        }                                                 \
    } while (0)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* The byte at column byte b of neuron r's gate, up or down_T row (part 0, 1, 2). */
static uint8_t weight_byte(int64_t r, size_t b, int part) {
    return (uint8_t)(r * 31 + b * 7 + part * 101 + 1);
}

/* Writes every neuron's gate, up and down_T rows into its pool row, back to back. */
static void fill_rows(uint8_t *pool, size_t stride, int64_t n, const size_t part_bytes[3]) {
    for (int64_t r = 0; r < n; r++) {
        uint8_t *row = pool + (size_t)r * stride;
        for (int part = 0; part < 3; part++) {
            for (size_t b = 0; b < part_bytes[part]; b++) {
                *row++ = weight_byte(r, b, part);
            }
        }
    }
}

static void fill_pool(pc_cache *cache, int64_t n, const size_t part_bytes[3]) {
    fill_rows(pc_neuron_pool(cache), (size_t)pc_pool_row_bytes(cache), n, part_bytes);
}

/* 1 when position p of the active buffers holds neuron id's gate | up row (its up row only
 * with skip_gate) and down_T row, recomputed from weight_byte rather than read from the pool. */
static int active_row_is(pc_cache *cache, int64_t p, int32_t id, const size_t part_bytes[3],
                         int skip_gate) {
    size_t gate_bytes = skip_gate ? 0 : part_bytes[0];
    size_t gate_up_bytes = gate_bytes + part_bytes[1];
    const uint8_t *gate_up = (const uint8_t *)pc_active_gate_up(cache) + (size_t)p * gate_up_bytes;
    const uint8_t *down = (const uint8_t *)pc_active_down_T(cache) + (size_t)p * part_bytes[2];
    for (size_t b = 0; b < gate_bytes; b++) {
        if (gate_up[b] != weight_byte(id, b, 0)) {
            return 0;
        }
    }
    for (size_t b = 0; b < part_bytes[1]; b++) {
        if (gate_up[gate_bytes + b] != weight_byte(id, b, 1)) {
            return 0;
        }
    }
    for (size_t b = 0; b < part_bytes[2]; b++) {
        if (down[b] != weight_byte(id, b, 2)) {
            return 0;
        }
    }
    return 1;
}

static pc_config base_config(int64_t n, int64_t gate, int64_t up, int64_t hidden,
                             int64_t elem, int64_t cap) {
    pc_config c = {.n_rows = n, .gate_cols = gate, .up_cols = up, .hidden = hidden,
                   .elem_size = elem, .capacity = cap, .hybrid_tau = 0.5, .grain = 4,
                   .par_threshold = 8, .num_threads = 3};
    return c;
}

/* Builds a random mask from `old` (unchanged, empty, capacity rows, or a few or many rows
 * flipped). Every other mask marks its active rows with arbitrary nonzero bytes, as a caller's
 * uint8 mask may: the core must read any nonzero byte as active. Returns the active count. */
static int64_t random_mask(uint8_t *mask, const uint8_t *old, int64_t n, int64_t cap) {
    int kind = (int)(next_u64() % 6);
    if (kind == 0) { /* unchanged */
        memcpy(mask, old, (size_t)n);
    } else if (kind == 1) { /* empty */
        memset(mask, 0, (size_t)n);
    } else if (kind == 2) { /* exactly capacity rows */
        memset(mask, 0, (size_t)n);
        for (int64_t set = 0; set < cap;) {
            int64_t id = (int64_t)(next_u64() % (uint64_t)n);
            set += !mask[id];
            mask[id] = 1;
        }
    } else { /* flip a few rows of the old mask */
        memcpy(mask, old, (size_t)n);
        int64_t flips = 1 + (int64_t)(next_u64() % (uint64_t)(kind == 5 ? n : 6));
        for (int64_t f = 0; f < flips; f++) {
            int64_t id = (int64_t)(next_u64() % (uint64_t)n);
            mask[id] = !mask[id];
        }
    }
    int any_nonzero = (int)(next_u64() % 2);
    int64_t count = 0;
    for (int64_t id = 0; id < n; id++) {
        if (mask[id] && any_nonzero) {
            mask[id] = (uint8_t)(1 + next_u64() % 255);
        }
        count += mask[id] != 0;
    }
    return count;
}

/* mapped: the pool is a caller's buffer (pc_create_mapped), filled before the cache exists
 * and compared byte for byte after the run: the core must never write it. skip_gate: the
 * active buffers hold the up and down_T rows only. */
static void run_random(int64_t n, int64_t gate, int64_t up, int64_t hidden, int64_t elem,
                       int64_t cap, double tau, int steps, int mapped, int skip_gate) {
    pc_config cfg = base_config(n, gate, up, hidden, elem, cap);
    cfg.hybrid_tau = tau;
    cfg.skip_gate = skip_gate;
    pc_cache *cache = NULL;
    const size_t parts[3] = {(size_t)(gate * elem), (size_t)(up * elem), (size_t)(hidden * elem)};
    size_t stride = (size_t)pc_pool_row_stride(gate, up, hidden, elem);
    uint8_t *external = NULL, *pristine = NULL;
    if (mapped) {
        external = aligned_alloc(64, (size_t)n * stride);
        pristine = malloc((size_t)n * stride);
        memset(external, 0xA5, (size_t)n * stride);
        fill_rows(external, stride, n, parts);
        memcpy(pristine, external, (size_t)n * stride);
        CHECK(pc_create_mapped(&cfg, external, &cache) == PC_OK, "pc_create_mapped");
        CHECK(cache == NULL || (pc_neuron_pool(cache) == external && pc_pool_is_mapped(cache)),
              "mapped cache does not read the caller's pool");
    } else {
        CHECK(pc_create(&cfg, &cache) == PC_OK, "pc_create");
        if (cache != NULL) {
            CHECK(!pc_pool_is_mapped(cache), "own pool reported as mapped");
            fill_pool(cache, n, parts);
        }
    }
    if (cache == NULL) {
        free(external);
        free(pristine);
        return;
    }
    CHECK(pc_pool_row_bytes(cache) == (int64_t)stride, "pc_pool_row_stride disagrees");
    uint8_t *model = calloc((size_t)n, 1);
    uint8_t *mask = calloc((size_t)n, 1);
    char msg[256];
    for (int step = 0; step < steps; step++) {
        int64_t count = random_mask(mask, model, n, cap);
        pc_stats before;
        pc_get_stats(cache, &before);
        int64_t reported = -1;
        int rc = pc_update(cache, mask, &reported);
        CHECK(reported == count, "reported count %lld != %lld", (long long)reported,
              (long long)count);
        if (count > cap) {
            CHECK(rc == PC_ERR_CAPACITY, "over capacity accepted");
            CHECK(memcmp(pc_current_mask(cache), model, (size_t)n) == 0, "mask changed on error");
            pc_stats after;
            pc_get_stats(cache, &after);
            CHECK(after.updates == before.updates, "stats changed on error");
        } else {
            CHECK(rc == PC_OK, "update rc=%d", rc);
            for (int64_t id = 0; id < n; id++) {
                model[id] = mask[id] != 0;
            }
            CHECK(pc_num_active(cache) == count, "m=%lld != %lld",
                  (long long)pc_num_active(cache), (long long)count);
            pc_stats after;
            pc_get_stats(cache, &after);
            int64_t bound = after.last_added > after.last_removed ? after.last_added
                                                                  : after.last_removed;
            if (!after.last_was_rebuild) {
                CHECK(after.last_rows_copied <= bound, "copied %lld > max(A,R)=%lld",
                      (long long)after.last_rows_copied, (long long)bound);
            }
        }
        CHECK(memcmp(pc_current_mask(cache), model, (size_t)n) == 0, "mask != model");
        for (int64_t p = 0; p < pc_num_active(cache); p++) {
            int32_t id = pc_active_indices(cache)[p];
            CHECK(id >= 0 && id < n && active_row_is(cache, p, id, parts, skip_gate),
                  "position %lld does not hold neuron %d's rows", (long long)p, id);
        }
        rc = pc_check_valid(cache, msg, sizeof msg);
        CHECK(rc == PC_OK, "check_valid: %s", msg);
    }
    free(model);
    free(mask);
    pc_destroy(cache);
    if (mapped) {
        CHECK(memcmp(external, pristine, (size_t)n * stride) == 0, "mapped pool was written");
    }
    free(external);
    free(pristine);
}

static void test_mapped_errors(void) {
    pc_config cfg = base_config(16, 4, 4, 4, 4, 8);
    uint8_t *pool = aligned_alloc(64, 16 * 64 + 64);
    pc_cache *cache = (pc_cache *)&cfg; /* must be reset to NULL on failure */
    CHECK(pc_create_mapped(&cfg, NULL, &cache) == PC_ERR_CONFIG && cache == NULL, "NULL pool");
    cache = (pc_cache *)&cfg;
    CHECK(pc_create_mapped(&cfg, pool + 8, &cache) == PC_ERR_CONFIG && cache == NULL,
          "misaligned pool accepted");
    cfg.capacity = 0;
    CHECK(pc_create_mapped(&cfg, pool, &cache) == PC_ERR_CONFIG && cache == NULL,
          "bad config with a mapped pool");
    CHECK(pc_pool_row_stride(0, 0, 4, 4) == -1 && pc_pool_row_stride(1, 1, 1, 17) == -1,
          "pc_pool_row_stride accepted bad columns");
    free(pool);
}

static void test_config_errors(void) {
    pc_config good = base_config(16, 4, 4, 4, 4, 8);
    pc_config bad[10];
    for (int i = 0; i < 10; i++) {
        bad[i] = good;
    }
    bad[0].n_rows = 0;
    bad[1].capacity = 17;
    bad[2].capacity = 0;
    bad[3].up_cols = 0;
    bad[4].grain = 0;
    bad[5].num_threads = 0;
    bad[6].hybrid_tau = -1.0;
    bad[7].elem_size = 0;
    bad[8].skip_gate = 2;
    bad[9].skip_gate = 1; /* a gate to skip is needed */
    bad[9].gate_cols = 0;
    for (int i = 0; i < 10; i++) {
        pc_cache *cache = (pc_cache *)&good; /* must be reset to NULL on failure */
        CHECK(pc_create(&bad[i], &cache) == PC_ERR_CONFIG && cache == NULL, "bad config %d", i);
    }
    pc_config huge = base_config(INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, 16, 1);
    pc_cache *cache = NULL;
    CHECK(pc_create(&huge, &cache) == PC_ERR_CONFIG && cache == NULL, "overflowing config accepted");
}

static void test_corruption_detected(void) {
    pc_config cfg = base_config(32, 2, 2, 2, 4, 16);
    pc_cache *cache = NULL;
    CHECK(pc_create(&cfg, &cache) == PC_OK, "pc_create");
    const size_t parts[3] = {8, 8, 8};
    fill_pool(cache, 32, parts);
    uint8_t mask[32] = {0};
    mask[3] = mask[7] = mask[9] = 1;
    CHECK(pc_update(cache, mask, NULL) == PC_OK, "update");
    char msg[256];
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_OK, "valid before corruption: %s", msg);
    uint8_t *active = pc_active_gate_up(cache);
    active[2 * 4 + 1] ^= 0xFF; /* one byte of an up row */
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_ERR_INVALID, "row corruption missed");
    active[2 * 4 + 1] ^= 0xFF;
    pc_current_mask(cache)[4] = 1;
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_ERR_INVALID, "mask corruption missed");
    pc_current_mask(cache)[4] = 0;
    pc_index_to_position(cache)[3] = 2;
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_ERR_INVALID, "index corruption missed");
    pc_index_to_position(cache)[3] = 0;
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_OK, "valid after repair: %s", msg);
    /* The down_T part of row 9's pool row (position 2): the pool, not just the active rows,
     * is what the check compares against, at the down_T offset. */
    uint8_t *pool_down = (uint8_t *)pc_neuron_pool(cache) + 9 * pc_pool_row_bytes(cache) + 16;
    pool_down[5] ^= 0xFF;
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_ERR_INVALID, "pool down_T change missed");
    pool_down[5] ^= 0xFF;
    pc_destroy(cache);

    /* skip_gate: the active row is up only, compared with the pool's up part (at offset 8),
     * and the pool's gate part is nobody's copy. */
    cfg.skip_gate = 1;
    CHECK(pc_create(&cfg, &cache) == PC_OK, "pc_create skip_gate");
    fill_pool(cache, 32, parts);
    CHECK(pc_update(cache, mask, NULL) == PC_OK, "update skip_gate");
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_OK, "skip_gate valid: %s", msg);
    uint8_t *pool_row9 = (uint8_t *)pc_neuron_pool(cache) + 9 * pc_pool_row_bytes(cache);
    CHECK(memcmp((uint8_t *)pc_active_gate_up(cache) + 2 * 8, pool_row9 + 8, 8) == 0,
          "skip_gate: position 2 does not hold row 9's up part");
    pool_row9[8 + 3] ^= 0xFF;
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_ERR_INVALID, "skip_gate up change missed");
    pool_row9[8 + 3] ^= 0xFF;
    pool_row9[3] ^= 0xFF; /* its gate part */
    CHECK(pc_check_valid(cache, msg, sizeof msg) == PC_OK, "skip_gate compared the gate: %s", msg);
    pc_destroy(cache);
}

/* Pool rows are gate | up | down_T padded to a multiple of 64 bytes and of elem_size; the
 * pool and each of its rows start on a cache line. */
static void test_pool_row_stride(void) {
    struct {
        int64_t gate, up, hidden, elem, want;
    } cases[] = {
        {5, 7, 3, 4, 64},          /* 60 bytes: padded to one line */
        {0, 16, 16, 2, 64},        /* exactly one line, no gate */
        {1024, 1024, 1024, 2, 6144}, /* bfloat16 SmolLM-like: 6 KiB, no padding */
        {1, 1, 1, 3, 192},         /* 9 bytes of 3-byte elements: lcm(64, 3) */
        {3, 3, 3, 16, 192},        /* 144 bytes of 16-byte elements */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pc_config cfg =
            base_config(8, cases[i].gate, cases[i].up, cases[i].hidden, cases[i].elem, 4);
        pc_cache *cache = NULL;
        CHECK(pc_create(&cfg, &cache) == PC_OK, "pc_create case %zu", i);
        if (cache == NULL) {
            continue;
        }
        CHECK(pc_pool_row_bytes(cache) == cases[i].want, "case %zu: stride %lld != %lld", i,
              (long long)pc_pool_row_bytes(cache), (long long)cases[i].want);
        CHECK((uintptr_t)pc_neuron_pool(cache) % 64 == 0, "case %zu: pool not 64-byte aligned", i);
        pc_destroy(cache);
    }
}

/* pc_rows_mlp_f32 against a double-precision sum over the same pool rows: column counts
 * that are and are not multiples of the 8- and 16-float steps, an empty and a full pick,
 * ids in any order, and the refusals (not float32, an id out of range) leaving out as it was;
 * pc_rows_mlp_split_f32 over the same rows in two arrays gives the same bits. */
static void test_rows_mlp(int64_t n, int64_t gate, int64_t up, int64_t hidden, int mapped) {
    pc_config cfg = base_config(n, gate, up, hidden, 4, n);
    size_t stride = (size_t)pc_pool_row_stride(gate, up, hidden, 4);
    uint8_t *pool = NULL;
    float *rows = NULL;
    pc_cache *cache = NULL;
    if (mapped) {
        pool = aligned_alloc(64, stride * (size_t)n); /* stride: a multiple of 64 */
        CHECK(pool != NULL, "alloc pool");
        CHECK(pc_create_mapped(&cfg, pool, &cache) == PC_OK, "pc_create_mapped");
    } else {
        CHECK(pc_create(&cfg, &cache) == PC_OK, "pc_create");
    }
    if (cache == NULL) {
        free(pool);
        return;
    }
    uint8_t *base = pc_neuron_pool(cache);
    for (int64_t r = 0; r < n; r++) {
        rows = (float *)(base + (size_t)r * stride);
        for (int64_t c = 0; c < gate + up + hidden; c++)
            rows[c] = (float)((int64_t)(next_u64() % 2001) - 1000) / 1000.0f;
    }
    float *x = malloc((size_t)up * sizeof(float));
    float *g = malloc((size_t)n * sizeof(float));
    float *out = malloc((size_t)hidden * sizeof(float));
    double *want = malloc((size_t)hidden * sizeof(double));
    double *mag = malloc((size_t)hidden * sizeof(double)); /* the sum of |terms| per column */
    int32_t *idx = malloc((size_t)n * sizeof(int32_t));
    float *split_up = malloc((size_t)(n * up) * sizeof(float));
    float *split_down = malloc((size_t)(n * hidden) * sizeof(float));
    float *split_out = malloc((size_t)hidden * sizeof(float));
    for (int64_t c = 0; c < up; c++) x[c] = (float)((int64_t)(next_u64() % 2001) - 1000) / 500.0f;
    for (int trial = 0; trial < 20; trial++) {
        int64_t m = trial == 0 ? 0 : trial == 1 ? n : (int64_t)(next_u64() % (uint64_t)(n + 1));
        for (int64_t k = 0; k < m; k++) {
            idx[k] = trial == 1 ? (int32_t)(n - 1 - k) : (int32_t)(next_u64() % (uint64_t)n);
            g[k] = (float)((int64_t)(next_u64() % 2001) - 1000) / 1000.0f;
        }
        for (int64_t c = 0; c < hidden; c++) want[c] = mag[c] = 0.0;
        for (int64_t k = 0; k < m; k++) {
            const float *row = (const float *)(base + (size_t)idx[k] * stride);
            double h = 0.0, habs = 0.0;
            for (int64_t c = 0; c < up; c++) {
                h += (double)x[c] * row[gate + c];
                habs += fabs((double)x[c] * row[gate + c]);
            }
            for (int64_t c = 0; c < hidden; c++) {
                want[c] += h * g[k] * row[gate + up + c];
                mag[c] += habs * fabs(g[k] * row[gate + up + c]);
            }
        }
        for (int64_t c = 0; c < hidden; c++) out[c] = 12345.0f;
        CHECK(pc_rows_mlp_f32(cache, x, g, idx, m, out) == PC_OK, "rows_mlp m=%lld", (long long)m);
        for (int64_t c = 0; c < hidden; c++)
            /* float32 sums: each term off by at most (up + m + 2) roundings of 2^-24 */
            CHECK(fabs(out[c] - want[c]) <= 6e-8 * (double)(up + m + 2) * mag[c] + 1e-30,
                  "rows_mlp n=%lld up=%lld hidden=%lld m=%lld col %lld: %g != %g", (long long)n,
                  (long long)up, (long long)hidden, (long long)m, (long long)c, out[c], want[c]);
        /* pc_rows_mlp_split_f32 over the same rows in two arrays (all n rows, read at idx):
         * the same products in the same order, so the same bits. */
        for (int64_t r = 0; r < n; r++) {
            const float *row = (const float *)(base + (size_t)r * stride);
            memcpy(split_up + r * up, row + gate, (size_t)up * sizeof(float));
            memcpy(split_down + r * hidden, row + gate + up, (size_t)hidden * sizeof(float));
        }
        for (int64_t c = 0; c < hidden; c++) split_out[c] = -1.0f;
        CHECK(pc_rows_mlp_split_f32(x, g, idx, m, split_up, split_down, n, up, hidden, split_out) ==
                  PC_OK,
              "rows_mlp_split m=%lld", (long long)m);
        CHECK(memcmp(out, split_out, (size_t)hidden * sizeof(float)) == 0,
              "rows_mlp_split differs from rows_mlp (m=%lld)", (long long)m);
    }
    for (int64_t c = 0; c < hidden; c++) split_out[c] = 7.0f;
    idx[0] = (int32_t)n;
    CHECK(pc_rows_mlp_split_f32(x, g, idx, 1, split_up, split_down, n, up, hidden, split_out) ==
              PC_ERR_INVALID,
          "split: id N accepted");
    CHECK(pc_rows_mlp_split_f32(x, g, idx, 1, NULL, split_down, n, up, hidden, split_out) ==
              PC_ERR_CONFIG,
          "split: NULL up accepted");
    CHECK(pc_rows_mlp_split_f32(x, g, idx, 1, split_up, split_down, n, 0, hidden, split_out) ==
              PC_ERR_CONFIG,
          "split: up_cols 0 accepted");
    for (int64_t c = 0; c < hidden; c++) CHECK(split_out[c] == 7.0f, "a refused split call wrote out");
    free(split_up);
    free(split_down);
    free(split_out);
    for (int64_t c = 0; c < hidden; c++) out[c] = 7.0f;
    idx[0] = (int32_t)n;
    CHECK(pc_rows_mlp_f32(cache, x, g, idx, 1, out) == PC_ERR_INVALID, "id N accepted");
    idx[0] = -1;
    CHECK(pc_rows_mlp_f32(cache, x, g, idx, 1, out) == PC_ERR_INVALID, "id -1 accepted");
    CHECK(pc_rows_mlp_f32(cache, x, g, idx, -1, out) == PC_ERR_CONFIG, "m -1 accepted");
    for (int64_t c = 0; c < hidden; c++) CHECK(out[c] == 7.0f, "a refused call wrote out");
    pc_destroy(cache);
    cfg = base_config(n, gate, up, hidden, 2, n);
    CHECK(pc_create(&cfg, &cache) == PC_OK, "pc_create elem 2");
    if (cache != NULL) {
        idx[0] = 0;
        CHECK(pc_rows_mlp_f32(cache, x, g, idx, 1, out) == PC_ERR_CONFIG, "elem 2 accepted");
        pc_destroy(cache);
    }
    free(x);
    free(g);
    free(out);
    free(want);
    free(mag);
    free(idx);
    free(pool);
}

/* pc_select_gated_f32. Without an up estimate (score |g|, exact) against a brute-force
 * count: a row is picked iff fewer than k rows outrank it (a higher score, or an equal one
 * and a lower id), with many ties (small integers), zeros of both signs, +inf and NaN
 * (above +inf, as torch.topk ranks it). With one (E|u| by a polynomial exp and erf) against
 * the exact E|u| in double: no row left out scores above a picked one by more than 1e-6.
 * k = 1 and k = n; ids ascending with g at them; the refusals write nothing. */
static double exact_score(const float *g, const float *mean, const float *sd, int64_t i) {
    double s = fabs((double)g[i]);
    if (mean == NULL) return s;
    double m = mean[i], d = sd[i];
    if (!(d > 0.0)) return s * fabs(m);
    double z = m / d;
    return s * (d * 0.79788456080286535588 * exp(-0.5 * z * z) + m * erf(z / sqrt(2.0)));
}

/* a outranks b: NaN above everything, then by value (-0 equals 0); slack: by more than
 * that relative margin. */
static int outranks(double a, double b, double slack) {
    if (isnan(b)) return 0;
    return isnan(a) || a > b * (1.0 + slack);
}

/* The scoring's E|u| against the exact value in double, over |mean/sd| from 0 to 40 and sd
 * from 1e-3 to 1e3, signs both ways, and sd 0. */
static void test_expected_abs(void) {
    enum { N = 8001 };
    static float mean[N], sd[N], out[N];
    for (int64_t i = 0; i < N; i++) {
        double z = (double)(i - N / 2) / 100.0; /* -40 .. 40 */
        sd[i] = (float)pow(10.0, (double)(i % 7) - 3.0);
        mean[i] = (float)(z * sd[i]);
    }
    sd[17] = 0.0f;
    pc_expected_abs_f32(mean, sd, N, out);
    double worst = 0.0;
    for (int64_t i = 0; i < N; i++) {
        double m = mean[i], d = sd[i], want = fabs(m);
        if (d > 0.0) {
            double z = m / d;
            want = d * 0.79788456080286535588 * exp(-0.5 * z * z) + m * erf(z / sqrt(2.0));
        }
        double rel = fabs(out[i] - want) / want;
        if (rel > worst) worst = rel;
    }
    CHECK(worst <= 5e-7, "expected_abs: relative error %g > 5e-7", worst);
    CHECK(out[17] == fabsf(mean[17]), "expected_abs: sd 0 is not |mean|");
}

static void test_select_gated(int64_t n, int with_up, int ties) {
    float *g = malloc((size_t)n * sizeof(float));
    float *mean = malloc((size_t)n * sizeof(float));
    float *sd = malloc((size_t)n * sizeof(float));
    int32_t *idx = malloc((size_t)n * sizeof(int32_t));
    float *g_at = malloc((size_t)n * sizeof(float));
    double *score = malloc((size_t)n * sizeof(double));
    uint8_t *picked = malloc((size_t)n);
    for (int trial = 0; trial < 12; trial++) {
        for (int64_t i = 0; i < n; i++) {
            int64_t r = (int64_t)(next_u64() % 2001) - 1000;
            g[i] = ties ? (float)(r % 4) : (float)r / 997.0f;
            if (trial % 3 == 1 && i % 7 == 3) g[i] = -0.0f;
            if (trial % 3 == 2 && i == n / 2) g[i] = NAN;
            if (trial % 3 == 2 && i == n / 3 && n > 3) g[i] = INFINITY;
            /* |mean/sd| from 0 to beyond 13 (e^(-z^2/2) down to the clamp), sd 0 too */
            mean[i] = (float)((int64_t)(next_u64() % 2001) - 1000) / 500.0f;
            sd[i] = (i % 5 == 0) ? 0.0f : (float)(next_u64() % 1000 + 1) / 800.0f;
            if (i % 11 == 4) sd[i] /= 64.0f;
        }
        const float *m = with_up ? mean : NULL, *s = with_up ? sd : NULL;
        for (int64_t i = 0; i < n; i++) score[i] = exact_score(g, m, s, i);
        int64_t k = trial == 0 ? 1 : trial == 1 ? n : 1 + (int64_t)(next_u64() % (uint64_t)n);
        for (int64_t i = 0; i < k; i++) idx[i] = -1;
        CHECK(pc_select_gated_f32(g, m, s, n, k, idx, g_at) == PC_OK, "select n=%lld k=%lld",
              (long long)n, (long long)k);
        memset(picked, 0, (size_t)n);
        for (int64_t j = 0; j < k; j++) {
            CHECK(idx[j] >= 0 && idx[j] < n && (j == 0 || idx[j] > idx[j - 1]),
                  "select: ids not ascending in [0, n) at %lld", (long long)j);
            if (idx[j] < 0 || idx[j] >= n) continue;
            picked[idx[j]] = 1;
            CHECK(g_at[j] == g[idx[j]] || (isnan(g_at[j]) && isnan(g[idx[j]])), "select: g_at %lld",
                  (long long)j);
        }
        for (int64_t i = 0; i < n; i++) {
            if (!with_up) { /* exact: the brute-force count decides */
                int64_t above = 0;
                for (int64_t j = 0; j < n; j++)
                    above += outranks(score[j], score[i], 0.0) ||
                             (!outranks(score[i], score[j], 0.0) && j < i);
                CHECK(picked[i] == (above < k), "select n=%lld k=%lld: row %lld %s", (long long)n,
                      (long long)k, (long long)i, picked[i] ? "picked" : "missed");
            } else if (!picked[i]) { /* within the polynomials' rounding */
                for (int64_t j = 0; j < n; j++)
                    CHECK(!picked[j] || !outranks(score[i], score[j], 1e-6),
                          "select n=%lld k=%lld: row %lld (%g) left out, row %lld (%g) picked",
                          (long long)n, (long long)k, (long long)i, score[i], (long long)j,
                          score[j]);
            }
        }
    }
    idx[0] = -7;
    CHECK(pc_select_gated_f32(g, mean, sd, n, 0, idx, g_at) == PC_ERR_CONFIG, "k 0 accepted");
    CHECK(pc_select_gated_f32(g, mean, sd, n, n + 1, idx, g_at) == PC_ERR_CONFIG, "k n+1 accepted");
    CHECK(pc_select_gated_f32(g, mean, NULL, n, 1, idx, g_at) == PC_ERR_CONFIG, "no sd accepted");
    CHECK(pc_select_gated_f32(g, NULL, NULL, n, 1, NULL, g_at) == PC_ERR_CONFIG, "NULL idx");
    CHECK(idx[0] == -7, "a refused select wrote idx");
    free(g);
    free(mean);
    free(sd);
    free(idx);
    free(g_at);
    free(score);
    free(picked);
}

/* A float16's bits as a float, computed another way than the core's (ldexpf). */
static float f16_value(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}

/* A random finite float16: normal, subnormal or zero, either sign. */
static uint16_t random_f16(void) {
    uint64_t r = next_u64();
    uint16_t e = (uint16_t)((r >> 11) % 31); /* 0..30: no infinity, no NaN */
    if ((r >> 20) % 4 == 0) e = 0;           /* subnormals (and zeros) a quarter of the time */
    return (uint16_t)(((r >> 16) & 1) << 15 | e << 10 | (r & 0x3ff));
}

static uint8_t code_at(const uint8_t *codes, int bits, int64_t c, float *q) {
    if (bits == 4) {
        uint8_t v = (uint8_t)((codes[c / 2] >> ((c % 2) * 4)) & 15);
        *q = (float)v;
        return v;
    }
    *q = (float)(int8_t)codes[c];
    return codes[c];
}

/* pc_grid_rows_mlp_f32 against pc_rows_mlp_split_f32 over the rows decoded here (d * q,
 * then + m, with float16 decoded by f16_value): the same bits. Records are allocated to the
 * byte (n * record_bytes), so a read past the last one is valgrind's; an odd hidden ends a
 * 4-bit down_T row on a half byte. Then the refusals, leaving out as it was. */
static void test_grid_rows_mlp(int64_t n, int64_t up, int64_t hidden, int up_bits, int up_affine,
                               int down_bits, int down_affine) {
    const int64_t block = PC_GRID_BLOCK, up_codes = (up * up_bits + 7) / 8;
    const int64_t scales = (up / block) * 2, down_at = up_codes + scales * (up_affine ? 2 : 1);
    const int64_t record = down_at + (hidden * down_bits + 7) / 8, groups = n / block;
    uint8_t *records = malloc((size_t)(n * record));
    uint16_t *down_d = malloc((size_t)(groups * hidden) * sizeof(uint16_t));
    uint16_t *down_m = malloc((size_t)(groups * hidden) * sizeof(uint16_t));
    float *split_up = malloc((size_t)(n * up) * sizeof(float));
    float *split_down = malloc((size_t)(n * hidden) * sizeof(float));
    float *x = malloc((size_t)up * sizeof(float)), *g = malloc((size_t)n * sizeof(float));
    float *row = malloc((size_t)(up + hidden) * sizeof(float));
    float *out = malloc((size_t)hidden * sizeof(float)), *want = malloc((size_t)hidden * sizeof(float));
    int64_t *idx = malloc((size_t)n * sizeof(int64_t));
    int32_t *idx32 = malloc((size_t)n * sizeof(int32_t));
    for (int64_t b = 0; b < n * record; b++) records[b] = (uint8_t)next_u64();
    for (int64_t r = 0; r < n; r++) { /* the scales: finite float16 */
        uint8_t *s = records + r * record + up_codes;
        for (int64_t k = 0; k < scales * (up_affine ? 2 : 1) / 2; k++) {
            uint16_t h = random_f16();
            memcpy(s + 2 * k, &h, sizeof h);
        }
    }
    for (int64_t k = 0; k < groups * hidden; k++) down_d[k] = random_f16(), down_m[k] = random_f16();
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *rec = records + r * record;
        for (int64_t c = 0; c < up; c++) {
            uint16_t d, mn;
            float q;
            memcpy(&d, rec + up_codes + 2 * (c / block), sizeof d);
            memcpy(&mn, rec + up_codes + scales + 2 * (c / block), sizeof mn);
            code_at(rec, up_bits, c, &q);
            float w = f16_value(d) * q;
            if (up_affine) w = w + f16_value(mn);
            split_up[r * up + c] = w;
        }
        for (int64_t c = 0; c < hidden; c++) {
            float q;
            code_at(rec + down_at, down_bits, c, &q);
            float w = f16_value(down_d[(r / block) * hidden + c]) * q;
            if (down_affine) w = w + f16_value(down_m[(r / block) * hidden + c]);
            split_down[r * hidden + c] = w;
        }
    }
    for (int64_t c = 0; c < up; c++) x[c] = (float)((int64_t)(next_u64() % 2001) - 1000) / 500.0f;
    for (int trial = 0; trial < 12; trial++) {
        int64_t m = trial == 0 ? 0 : trial == 1 ? n : (int64_t)(next_u64() % (uint64_t)(n + 1));
        for (int64_t k = 0; k < m; k++) {
            idx[k] = trial == 1 ? n - 1 - k : (int64_t)(next_u64() % (uint64_t)n);
            idx32[k] = (int32_t)idx[k];
            g[k] = (float)((int64_t)(next_u64() % 2001) - 1000) / 1000.0f;
        }
        for (int64_t c = 0; c < hidden; c++) out[c] = 12345.0f, want[c] = -1.0f;
        CHECK(pc_rows_mlp_split_f32(x, g, idx32, m, split_up, split_down, n, up, hidden, want) ==
                  PC_OK,
              "grid: split m=%lld", (long long)m);
        CHECK(pc_grid_rows_mlp_f32(x, g, idx, m, records, record, n, up_bits, up_affine, up,
                                   down_bits, down_d, down_affine ? down_m : NULL, hidden, row,
                                   out) == PC_OK,
              "grid rows_mlp m=%lld", (long long)m);
        CHECK(memcmp(out, want, (size_t)hidden * sizeof(float)) == 0,
              "grid rows_mlp differs from split over the decoded rows (n=%lld up=%lld hidden=%lld "
              "kinds %d%d/%d%d m=%lld)",
              (long long)n, (long long)up, (long long)hidden, up_bits, up_affine, down_bits,
              down_affine, (long long)m);
    }
    const uint16_t *dm = down_affine ? down_m : NULL;
    for (int64_t c = 0; c < hidden; c++) out[c] = 7.0f;
    idx[0] = n;
    CHECK(pc_grid_rows_mlp_f32(x, g, idx, 1, records, record, n, up_bits, up_affine, up, down_bits,
                               down_d, dm, hidden, row, out) == PC_ERR_INVALID,
          "grid: id N accepted");
    idx[0] = -1;
    CHECK(pc_grid_rows_mlp_f32(x, g, idx, 1, records, record, n, up_bits, up_affine, up, down_bits,
                               down_d, dm, hidden, row, out) == PC_ERR_INVALID,
          "grid: id -1 accepted");
    idx[0] = 0;
    CHECK(pc_grid_rows_mlp_f32(x, g, idx, 1, records, record + 1, n, up_bits, up_affine, up,
                               down_bits, down_d, dm, hidden, row, out) == PC_ERR_CONFIG,
          "grid: a wrong record size accepted");
    CHECK(pc_grid_rows_mlp_f32(x, g, idx, 1, records, record, n, 3, up_affine, up, down_bits,
                               down_d, dm, hidden, row, out) == PC_ERR_CONFIG,
          "grid: 3-bit codes accepted");
    CHECK(pc_grid_rows_mlp_f32(x, g, idx, 1, records, record, n, up_bits, up_affine, up, down_bits,
                               NULL, dm, hidden, row, out) == PC_ERR_CONFIG,
          "grid: NULL down scales accepted");
    CHECK(pc_grid_rows_mlp_f32(x, g, idx, 1, records, record, n, up_bits, up_affine, up, down_bits,
                               down_d, dm, hidden, NULL, out) == PC_ERR_CONFIG,
          "grid: NULL workspace accepted");
    CHECK(pc_grid_rows_mlp_f32(x, g, idx, 1, records, record, n + 1, up_bits, up_affine, up,
                               down_bits, down_d, dm, hidden, row, out) == PC_ERR_CONFIG,
          "grid: rows not a multiple of the block accepted");
    for (int64_t c = 0; c < hidden; c++) CHECK(out[c] == 7.0f, "a refused grid call wrote out");
    free(records);
    free(down_d);
    free(down_m);
    free(split_up);
    free(split_down);
    free(x);
    free(g);
    free(row);
    free(out);
    free(want);
    free(idx);
    free(idx32);
}

int main(void) {
    test_config_errors();
    test_corruption_detected();
    test_pool_row_stride();
    test_mapped_errors();
    test_rows_mlp(37, 21, 21, 13, 0);
    test_rows_mlp(64, 16, 16, 16, 1);
    test_rows_mlp(9, 5, 5, 3, 1);
    test_rows_mlp(200, 64, 64, 72, 0);
    test_grid_rows_mlp(64, 64, 5, 4, 1, 4, 1);  /* Q4_1 up and down, a half byte at the end */
    test_grid_rows_mlp(96, 32, 16, 8, 0, 8, 0); /* Q8_0 */
    test_grid_rows_mlp(32, 96, 7, 4, 1, 8, 0);  /* Q4_1 up, Q8_0 down (SmolLM2's grid test) */
    test_grid_rows_mlp(64, 64, 64, 8, 0, 4, 1);
    test_expected_abs();
    for (int with_up = 0; with_up < 2; with_up++) {
        test_select_gated(1, with_up, 0);
        test_select_gated(97, with_up, 0);
        test_select_gated(300, with_up, 1);
        test_select_gated(700, with_up, 0);
    }
    const int64_t elems[4] = {8, 4, 2, 1};
    for (int e = 0; e < 4; e++) {
        for (int mapped = 0; mapped < 2; mapped++) {
            run_random(64, 3, 5, 7, elems[e], 40, 0.5, 300, mapped, 0); /* gate on, hybrid */
            run_random(64, 3, 5, 7, elems[e], 40, 0.5, 300, mapped, 1); /* gate left in pool */
            run_random(64, 0, 5, 7, elems[e], 64, 0.5, 300, mapped, 0); /* no gate, capacity N */
            run_random(50, 4, 4, 4, elems[e], 20, 1e9, 300, mapped, 0); /* never rebuild */
            run_random(50, 4, 4, 4, elems[e], 20, 0.0, 100, mapped, 1); /* always rebuild */
        }
    }
    run_random(2048, 16, 16, 16, 4, 1024, 1e9, 40, 0, 0); /* enough rows for threads */
    run_random(2048, 16, 16, 16, 4, 1024, 1e9, 40, 1, 1);
    if (failures) {
        fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    printf("C core tests passed (%s)\n", pc_core_info());
    return 0;
}
