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

/* A float16's bits as the float32 it stands for, exactly (subnormals, infinities, NaN):
 * the exponent rebiased, a subnormal normalised by one exact float subtraction. No branch
 * on a normal value, so the loops below vectorise. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t shifted = 0x7c00u << 13; /* the exponent mask, after the shift */
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t exp = o & shifted;
    o += (uint32_t)(127 - 15) << 23;
    float f;
    if (exp == shifted) {
        o += (uint32_t)(128 - 16) << 23; /* infinity or NaN */
        memcpy(&f, &o, sizeof f);
    } else if (exp == 0) {
        o += 1u << 23; /* subnormal: 2^-14 * (1 + m / 1024) - 2^-14 */
        memcpy(&f, &o, sizeof f);
        f -= 6.103515625e-05f;
    } else {
        memcpy(&f, &o, sizeof f);
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= ((uint32_t)h & 0x8000u) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Codes n..n+count of a row as floats: bits 4, two per byte, the even one in the low
 * nibble (n even; an odd count ends the row); bits 8, int8. */
static inline void grid_codes(const uint8_t *codes, int bits, int64_t n, int64_t count,
                              float *q) {
    if (bits == 4) {
        const uint8_t *p = codes + n / 2;
        for (int64_t j = 0; j < count / 2; j++) {
            q[2 * j] = (float)(p[j] & 15);
            q[2 * j + 1] = (float)(p[j] >> 4);
        }
        if (count % 2) q[count - 1] = (float)(p[count / 2] & 15);
    } else {
        for (int64_t j = 0; j < count; j++) q[j] = (float)(int8_t)codes[n + j];
    }
}

/* One grid row decoded: w[c] = d * q[c] (+ m), two float32 roundings, a product then a
 * sum, as grid_pool.dequantize (the build keeps them two: -ffp-contract=off). up: d and m
 * per block of PC_GRID_BLOCK values, the record's own scales; down_T: per value, the
 * layer's scale rows d_row and m_row. */
static void grid_up_row(const uint8_t *codes, int bits, const uint8_t *d, const uint8_t *m,
                        int64_t n, float *w) {
    for (int64_t b = 0; b < n / PC_GRID_BLOCK; b++) {
        float *v = w + b * PC_GRID_BLOCK;
        grid_codes(codes, bits, b * PC_GRID_BLOCK, PC_GRID_BLOCK, v);
        const float db = f16_to_f32(load_u16(d + 2 * b));
        for (int j = 0; j < PC_GRID_BLOCK; j++) v[j] = db * v[j];
        if (m != NULL) {
            const float mb = f16_to_f32(load_u16(m + 2 * b));
            for (int j = 0; j < PC_GRID_BLOCK; j++) v[j] = v[j] + mb;
        }
    }
}

static void grid_down_row(const uint8_t *codes, int bits, const uint16_t *d_row,
                          const uint16_t *m_row, int64_t n, float *w) {
    grid_codes(codes, bits, 0, n, w);
    for (int64_t c = 0; c < n; c++) w[c] = f16_to_f32(d_row[c]) * w[c];
    if (m_row != NULL)
        for (int64_t c = 0; c < n; c++) w[c] = w[c] + f16_to_f32(m_row[c]);
}

int pc_grid_rows_mlp_f32(const float *x, const float *g, const int64_t *idx, int64_t m,
                         const uint8_t *records, int64_t record_bytes, int64_t n_rows,
                         int up_bits, int up_affine, int64_t up_cols, int down_bits,
                         const uint16_t *down_d, const uint16_t *down_m, int64_t hidden,
                         float *row, float *out) {
    if (m < 0 || n_rows < 0 || up_cols < 1 || hidden < 1 || x == NULL || out == NULL ||
        row == NULL || down_d == NULL || (up_bits != 4 && up_bits != 8) ||
        (down_bits != 4 && down_bits != 8) || up_cols % PC_GRID_BLOCK != 0 ||
        n_rows % PC_GRID_BLOCK != 0 || (m > 0 && (g == NULL || idx == NULL || records == NULL)))
        return PC_ERR_CONFIG;
    const int64_t up_codes = (up_cols * up_bits + 7) / 8, scales = (up_cols / PC_GRID_BLOCK) * 2;
    const int64_t down_at = up_codes + scales * (up_affine ? 2 : 1);
    if (record_bytes != down_at + (hidden * down_bits + 7) / 8) return PC_ERR_CONFIG;
    for (int64_t k = 0; k < m; k++)
        if (idx[k] < 0 || idx[k] >= n_rows) return PC_ERR_INVALID; /* before any write */
    memset(out, 0, (size_t)hidden * sizeof(float));
    float *up = row, *down = row + up_cols;
    for (int64_t k = 0; k < m; k++) {
        const uint8_t *rec = records + (size_t)idx[k] * (size_t)record_bytes;
        if (k + 1 < m) { /* the next record, while this one is decoded and multiplied */
            const uint8_t *next = records + (size_t)idx[k + 1] * (size_t)record_bytes;
            for (int64_t b = 0; b < record_bytes; b += 64) __builtin_prefetch(next + b);
        }
        const int64_t group = idx[k] / PC_GRID_BLOCK;
        grid_up_row(rec, up_bits, rec + up_codes, up_affine ? rec + up_codes + scales : NULL,
                    up_cols, up);
        grid_down_row(rec + down_at, down_bits, down_d + group * hidden,
                      down_m == NULL ? NULL : down_m + group * hidden, hidden, down);
        float h = g[k] * dot_f32(x, up, up_cols);
        axpy_f32(out, h, down, hidden);
    }
    return PC_OK;
}
