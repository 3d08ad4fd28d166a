/*
 * The C core's own test driver, run under valgrind memcheck by memcheck.sh.
 *
 * Random masks (empty, full, unchanged, capacity edge, small and large diffs) against a
 * plain array model; pc_check_valid and the model after every update; every error path.
 * Pools hold distinct bytes per row, so a row copied from the wrong place is caught.
 */
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

static void fill_pool(uint8_t *pool, int64_t n, size_t row_bytes, uint8_t salt) {
    for (int64_t r = 0; r < n; r++) {
        for (size_t b = 0; b < row_bytes; b++) {
            pool[(size_t)r * row_bytes + b] = (uint8_t)(r * 31 + b * 7 + salt);
        }
    }
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

static void run_random(int64_t n, int64_t gate, int64_t up, int64_t hidden, int64_t elem,
                       int64_t cap, double tau, int steps) {
    pc_config cfg = base_config(n, gate, up, hidden, elem, cap);
    cfg.hybrid_tau = tau;
    pc_cache *cache = NULL;
    CHECK(pc_create(&cfg, &cache) == PC_OK, "pc_create");
    if (cache == NULL) {
        return;
    }
    if (gate > 0) {
        fill_pool(pc_gate_pool(cache), n, (size_t)(gate * elem), 1);
    }
    fill_pool(pc_up_pool(cache), n, (size_t)(up * elem), 2);
    fill_pool(pc_down_pool_T(cache), n, (size_t)(hidden * elem), 3);
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
        rc = pc_check_valid(cache, msg, sizeof msg);
        CHECK(rc == PC_OK, "check_valid: %s", msg);
    }
    free(model);
    free(mask);
    pc_destroy(cache);
}

static void test_config_errors(void) {
    pc_config good = base_config(16, 4, 4, 4, 4, 8);
    pc_config bad[8];
    for (int i = 0; i < 8; i++) {
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
    for (int i = 0; i < 8; i++) {
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
    fill_pool(pc_up_pool(cache), 32, 8, 2);
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
    pc_destroy(cache);
}

int main(void) {
    test_config_errors();
    test_corruption_detected();
    const int64_t elems[4] = {8, 4, 2, 1};
    for (int e = 0; e < 4; e++) {
        run_random(64, 3, 5, 7, elems[e], 40, 0.5, 300);  /* gate on, hybrid default */
        run_random(64, 0, 5, 7, elems[e], 64, 0.5, 300);  /* gate off, capacity N */
        run_random(50, 4, 4, 4, elems[e], 20, 1e9, 300);  /* never rebuild */
        run_random(50, 4, 4, 4, elems[e], 20, 0.0, 100);  /* always rebuild */
    }
    run_random(2048, 16, 16, 16, 4, 1024, 1e9, 40); /* enough rows for the threaded path */
    if (failures) {
        fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    printf("C core tests passed (%s)\n", pc_core_info());
    return 0;
}
