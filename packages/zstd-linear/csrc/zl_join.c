/* Plane join: the decoder's hot loop after zstd (see zstd_linear.h for the layout). */
#include "zstd_linear.h"

#include <string.h>

#define ZL_STR2(x) #x
#define ZL_STR(x) ZL_STR2(x)

#ifndef ZL_SOURCE_DIGEST
#define ZL_SOURCE_DIGEST "unknown"
#endif

/* A rotate the compiler recognises; k is in 0..bits-1, and k == 0 must not shift by bits. */
static inline uint16_t rotr16(uint16_t v, unsigned k) {
    return (uint16_t)((v >> k) | (v << ((16u - k) & 15u)));
}

static inline uint32_t rotr32(uint32_t v, unsigned k) {
    return (v >> k) | (v << ((32u - k) & 31u));
}

/* One loop per width: the compiler vectorises each (byte loads widened, shifted, or'd).
 * out is written through memcpy so that any alignment is correct. */
static void join2(unsigned k, size_t n, const uint8_t *restrict p0, const uint8_t *restrict p1,
                  uint8_t *restrict out) {
    for (size_t i = 0; i < n; i++) {
        uint16_t v = (uint16_t)(p0[i] | (uint16_t)(p1[i] << 8));
        v = rotr16(v, k);
        memcpy(out + 2 * i, &v, 2);
    }
}

static void join4(unsigned k, size_t n, const uint8_t *restrict p0, const uint8_t *restrict p1,
                  const uint8_t *restrict p2, const uint8_t *restrict p3, uint8_t *restrict out) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) |
                     ((uint32_t)p3[i] << 24);
        v = rotr32(v, k);
        memcpy(out + 4 * i, &v, 4);
    }
}

/* The rotation is a constant in every layout; a switch lets each case's loop shift by an
 * immediate, which vectorises better than a variable shift. */
#define ZL_JOIN2_CASE(K) \
    case K:              \
        join2(K, n, p0, p1, out); \
        break;
#define ZL_JOIN4_CASE(K) \
    case K:              \
        join4(K, n, p0, p1, p2, p3, out); \
        break;

int zl_join(int width, int rotation, size_t n, const uint8_t *p0, const uint8_t *p1,
            const uint8_t *p2, const uint8_t *p3, uint8_t *out) {
    if (width != 2 && width != 4) return ZL_ERR_WIDTH;
    if (rotation < 0 || rotation >= 8 * width) return ZL_ERR_ROTATION;
    if (n == 0) return ZL_OK;
    if (!p0 || !p1 || !out || (width == 4 && (!p2 || !p3))) return ZL_ERR_NULL;
    if (width == 2) {
        switch (rotation) {
            ZL_JOIN2_CASE(0)
            ZL_JOIN2_CASE(1)
            ZL_JOIN2_CASE(2)
            default:
                join2((unsigned)rotation, n, p0, p1, out);
        }
    } else {
        switch (rotation) {
            ZL_JOIN4_CASE(0)
            ZL_JOIN4_CASE(1)
            ZL_JOIN4_CASE(2)
            default:
                join4((unsigned)rotation, n, p0, p1, p2, p3, out);
        }
    }
    return ZL_OK;
}

const char *zl_core_info(void) {
    return "C" ZL_STR(__STDC_VERSION__) " sha256:" ZL_SOURCE_DIGEST;
}
