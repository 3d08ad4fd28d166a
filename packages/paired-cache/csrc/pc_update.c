/*
 * update(new_mask): paired replacement with a rebuild fallback.
 *
 * Phase 1 diffs the masks (added = new & ~old, removed = old & ~new) and checks capacity
 * before anything changes. Phase 2 overwrites removed rows' positions with added rows in
 * place; phase 3 appends the added rows left over; phase 4 closes the holes the leftover
 * removed rows leave by moving rows down from the end. Every copy of one update reads a
 * row nobody writes and writes a distinct position, so all copies run in one parallel
 * section before the metadata is updated sequentially. When |added| + |removed| exceeds
 * hybrid_tau * m, gathering the new set from the pools (rebuild) replaces the diff.
 */
#include <string.h>

#include "pc_internal.h"

typedef struct {
    pc_cache *cache;
    const pc_copy *copies;
} copy_ctx;

static void copy_rows(void *arg, int64_t begin, int64_t end) {
    const copy_ctx *ctx = arg;
    const pc_cache *c = ctx->cache;
    for (int64_t j = begin; j < end; j++) {
        const pc_copy *cp = &ctx->copies[j];
        uint8_t *gate_up = c->active_gate_up + (size_t)cp->dst * c->gate_up_row_bytes;
        uint8_t *down = c->active_down_T + (size_t)cp->dst * c->down_row_bytes;
        if (cp->from_pool) {
            size_t src = (size_t)cp->src;
            if (c->gate_row_bytes > 0) {
                memcpy(gate_up, c->gate_pool + src * c->gate_row_bytes, c->gate_row_bytes);
            }
            memcpy(gate_up + c->gate_row_bytes, c->up_pool + src * c->up_row_bytes,
                   c->up_row_bytes);
            memcpy(down, c->down_pool_T + src * c->down_row_bytes, c->down_row_bytes);
        } else {
            memcpy(gate_up, c->active_gate_up + (size_t)cp->src * c->gate_up_row_bytes,
                   c->gate_up_row_bytes);
            memcpy(down, c->active_down_T + (size_t)cp->src * c->down_row_bytes,
                   c->down_row_bytes);
        }
    }
}

static void run_copies(pc_cache *c, int64_t n) {
    copy_ctx ctx = {.cache = c, .copies = c->copies};
    pc_pool_for(c->pool, n, c->cfg.grain, c->cfg.par_threshold, copy_rows, &ctx);
}

static int64_t rebuild(pc_cache *c, const uint8_t *new_mask) {
    for (int64_t p = 0; p < c->m; p++) {
        c->index_to_position[c->active_indices[p]] = -1;
    }
    int64_t m = 0;
    for (int64_t id = 0; id < c->cfg.n_rows; id++) {
        if (new_mask[id]) {
            c->copies[m] = (pc_copy){.dst = (int32_t)m, .src = (int32_t)id, .from_pool = 1};
            c->active_indices[m] = (int32_t)id;
            c->index_to_position[id] = (int32_t)m;
            m++;
        }
    }
    run_copies(c, m);
    c->m = m;
    return m;
}

/* More added rows than removed (or as many): pair every removed row, append the rest. */
static int64_t pair_and_append(pc_cache *c, int64_t na, int64_t nr) {
    for (int64_t i = 0; i < na; i++) {
        int32_t dst = i < nr ? c->index_to_position[c->removed[i]] : (int32_t)(c->m + i - nr);
        c->copies[i] = (pc_copy){.dst = dst, .src = c->added[i], .from_pool = 1};
    }
    run_copies(c, na);
    for (int64_t i = 0; i < na; i++) {
        int32_t dst = c->copies[i].dst;
        if (i < nr) {
            c->index_to_position[c->removed[i]] = -1;
        }
        c->active_indices[dst] = c->added[i];
        c->index_to_position[c->added[i]] = dst;
    }
    c->m += na - nr;
    return na;
}

/*
 * More removed rows than added: pair the added rows with the lowest removed positions, so
 * that the leftover removed rows sit as high as possible and as few rows as possible have
 * to move down into holes below the new end. Rows copied <= |removed| = max(|A|, |R|).
 */
static int64_t pair_and_compact(pc_cache *c, int64_t na, int64_t nr) {
    int64_t m = c->m;
    int64_t new_m = m - (nr - na);
    memset(c->position_flags, 0, (size_t)m);
    for (int64_t i = 0; i < nr; i++) {
        c->position_flags[c->index_to_position[c->removed[i]]] = 1;
    }
    int64_t k = 0;
    for (int64_t p = 0; p < m; p++) {
        if (c->position_flags[p]) {
            c->removed_pos[k++] = (int32_t)p;
        }
    }
    int64_t n = 0;
    for (int64_t i = 0; i < na; i++) {
        c->copies[n++] = (pc_copy){.dst = c->removed_pos[i], .src = c->added[i], .from_pool = 1};
    }
    /* Holes: leftover removed positions below new_m, ascending. Survivors: unflagged
     * positions at or above new_m. The two counts are equal, and no paired position is
     * at or above new_m (the nr - na leftovers above it fill [new_m, m) exactly). */
    int64_t s = new_m;
    for (int64_t h = na; h < nr && c->removed_pos[h] < new_m; h++) {
        while (c->position_flags[s]) {
            s++;
        }
        c->copies[n++] = (pc_copy){.dst = c->removed_pos[h], .src = (int32_t)s, .from_pool = 0};
        s++;
    }
    run_copies(c, n);
    for (int64_t i = 0; i < nr; i++) {
        c->index_to_position[c->removed[i]] = -1;
    }
    for (int64_t j = 0; j < n; j++) {
        const pc_copy *cp = &c->copies[j];
        int32_t id = cp->from_pool ? cp->src : c->active_indices[cp->src];
        c->active_indices[cp->dst] = id;
        c->index_to_position[id] = cp->dst;
    }
    c->m = new_m;
    return n;
}

int pc_update(pc_cache *c, const uint8_t *new_mask, int64_t *out_new_count) {
    int64_t na = 0, nr = 0, new_count = 0;
    for (int64_t id = 0; id < c->cfg.n_rows; id++) {
        uint8_t now = new_mask[id] != 0;
        uint8_t was = c->current_mask[id];
        new_count += now;
        if (now && !was) {
            c->added[na++] = (int32_t)id;
        } else if (was && !now) {
            c->removed[nr++] = (int32_t)id;
        }
    }
    if (out_new_count != NULL) {
        *out_new_count = new_count;
    }
    if (new_count > c->cfg.capacity) {
        return PC_ERR_CAPACITY; /* checked before any change: the cache is as it was */
    }
    int64_t k = na + nr;
    int is_rebuild = k > 0 && (double)k > c->cfg.hybrid_tau * (double)c->m;
    int64_t copied = 0;
    if (is_rebuild) {
        copied = rebuild(c, new_mask);
    } else if (na >= nr) {
        copied = pair_and_append(c, na, nr);
    } else {
        copied = pair_and_compact(c, na, nr);
    }
    for (int64_t id = 0; id < c->cfg.n_rows; id++) {
        c->current_mask[id] = new_mask[id] != 0;
    }
    pc_stats *st = &c->stats;
    st->updates++;
    st->rebuilds += is_rebuild;
    st->paired_updates += k > 0 && !is_rebuild;
    st->rows_copied += copied;
    st->bytes_moved += copied * (int64_t)(c->gate_up_row_bytes + c->down_row_bytes);
    st->last_rows_copied = copied;
    st->last_added = na;
    st->last_removed = nr;
    st->last_was_rebuild = is_rebuild;
    return PC_OK;
}
