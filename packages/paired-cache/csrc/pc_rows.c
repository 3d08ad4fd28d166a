/* The in-place sparse MLP of one token: the rows a mask picked, multiplied where they lie in
 * the neuron pool (a file mapping, typically), with no copy into active buffers.
 *
 * For every picked neuron j the pool row holds gate_j | up_j | down_T_j back to back, so
 * one pass over the row's up | down_T part (contiguous, (up_cols + hidden) elements) does
 * both of the neuron's products: h_j = g_j * (x . up_j), then out += h_j * down_T_j. The
 * bytes read are exactly the picked rows' up and down_T parts, read once; a gather into
 * packed buffers and two matmuls over them read them twice and write them once.
 *
 * The arithmetic runs on 4-float vectors (GCC/Clang vector extensions: SSE or NEON, no
 * -march) with four accumulators per dot product, so the sums round differently from torch's matmuls (float32 rounding, ~1e-6
 * relative).
 */
#include <string.h>

#include "pc_internal.h"

/* 4 floats: one SSE or NEON register on any x86-64 or aarch64 (wider vectors would change
 * the calling convention without -march, which a wheel cannot assume). */
typedef float pc_v4 __attribute__((vector_size(16)));

static inline pc_v4 load4(const float *p) {
    pc_v4 v;
    memcpy(&v, p, sizeof v); /* unaligned-safe; compiles to one vector load */
    return v;
}

static inline void store4(float *p, pc_v4 v) { memcpy(p, &v, sizeof v); }

static float dot_f32(const float *a, const float *b, int64_t n) {
    pc_v4 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        s0 += load4(a + c) * load4(b + c);
        s1 += load4(a + c + 4) * load4(b + c + 4);
        s2 += load4(a + c + 8) * load4(b + c + 8);
        s3 += load4(a + c + 12) * load4(b + c + 12);
    }
    for (; c + 4 <= n; c += 4) s0 += load4(a + c) * load4(b + c);
    pc_v4 s = (s0 + s1) + (s2 + s3);
    float t = (s[0] + s[2]) + (s[1] + s[3]);
    for (; c < n; c++) t += a[c] * b[c];
    return t;
}

static void axpy_f32(float *out, float h, const float *d, int64_t n) {
    pc_v4 hv = {h, h, h, h};
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        store4(out + c, load4(out + c) + hv * load4(d + c));
        store4(out + c + 4, load4(out + c + 4) + hv * load4(d + c + 4));
    }
    for (; c + 4 <= n; c += 4) store4(out + c, load4(out + c) + hv * load4(d + c));
    for (; c < n; c++) out[c] += h * d[c];
}

/* out = sum over k of g[k] * dot(x, up row idx[k]) * down_T row idx[k], rows at base +
 * idx[k] * stride: the up row at offset 0, the down_T row at down_offset bytes from it
 * (a pool row), or up and down_T in two arrays (rows_mlp over split arrays). Row ids are
 * checked by the callers. */
static void rows_mlp(const float *x, const float *g, const int32_t *idx, int64_t m,
                     const uint8_t *up_base, size_t up_stride, const uint8_t *down_base,
                     size_t down_stride, int64_t up_cols, int64_t hidden, float *out) {
    memset(out, 0, (size_t)hidden * sizeof(float));
    for (int64_t k = 0; k < m; k++) {
        const float *up = (const float *)(up_base + (size_t)idx[k] * up_stride);
        const float *down = (const float *)(down_base + (size_t)idx[k] * down_stride);
        if (k + 1 < m) { /* the next row, while this one is multiplied */
            const uint8_t *next_up = up_base + (size_t)idx[k + 1] * up_stride;
            const uint8_t *next_down = down_base + (size_t)idx[k + 1] * down_stride;
            for (size_t b = 0; b < (size_t)up_cols * 4; b += 64) __builtin_prefetch(next_up + b);
            for (size_t b = 0; b < (size_t)hidden * 4; b += 64) __builtin_prefetch(next_down + b);
        }
        float h = g[k] * dot_f32(x, up, up_cols);
        axpy_f32(out, h, down, hidden);
    }
}

int pc_rows_mlp_f32(const pc_cache *cache, const float *x, const float *g, const int32_t *idx,
                    int64_t m, float *out) {
    const pc_config *c = &cache->cfg;
    if (c->elem_size != 4 || m < 0 || x == NULL || out == NULL || (m > 0 && (g == NULL || idx == NULL)))
        return PC_ERR_CONFIG;
    for (int64_t k = 0; k < m; k++)
        if (idx[k] < 0 || idx[k] >= c->n_rows) return PC_ERR_INVALID; /* before any write */
    const size_t up_offset = (size_t)c->gate_cols * 4, stride = cache->pool_row_bytes;
    const uint8_t *up = cache->neuron_pool + up_offset;
    rows_mlp(x, g, idx, m, up, stride, up + (size_t)c->up_cols * 4, stride, c->up_cols,
             c->hidden, out);
    return PC_OK;
}

int pc_rows_mlp_split_f32(const float *x, const float *g, const int32_t *idx, int64_t m,
                          const float *up, const float *down_T, int64_t n_rows, int64_t up_cols,
                          int64_t hidden, float *out) {
    if (m < 0 || n_rows < 0 || up_cols < 1 || hidden < 1 || x == NULL || out == NULL ||
        (m > 0 && (g == NULL || idx == NULL || up == NULL || down_T == NULL)))
        return PC_ERR_CONFIG;
    for (int64_t k = 0; k < m; k++)
        if (idx[k] < 0 || idx[k] >= n_rows) return PC_ERR_INVALID; /* before any write */
    rows_mlp(x, g, idx, m, (const uint8_t *)up, (size_t)up_cols * 4, (const uint8_t *)down_T,
             (size_t)hidden * 4, up_cols, hidden, out);
    return PC_OK;
}
