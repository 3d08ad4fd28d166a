/* Bit-packed planes: a byte plane whose constant bits are dropped (see zstd_linear.h). */
#include "zstd_linear.h"

#include <string.h>

/* Groups of 8 codes (k bytes each) whose 8-byte load stays inside the n codes' bytes. */
static inline size_t wide_groups(size_t n, unsigned k) {
    size_t bytes = (n / 8) * k + ((n % 8) * k + 7) / 8, groups = n / 8;
    if (bytes < 8) return 0;
    size_t wide = (bytes - 8) / k + 1;
    return wide < groups ? wide : groups;
}

/* The 8 k-bit codes packed in the low 8k bits of w, one per byte of the result: halved
 * three times (4 codes per 32-bit lane, 2 per 16-bit lane, 1 per byte), 12 operations
 * for 8 bytes instead of 32 for one shift and mask per code. */
static inline uint64_t spread(uint64_t w, unsigned k) {
    const uint64_t m4 = (1ull << (4 * k)) - 1u;
    const uint64_t m2 = ((1ull << (2 * k)) - 1u) * 0x0000000100000001ull;
    const uint64_t m1 = ((1ull << k) - 1u) * 0x0001000100010001ull;
    w = (w & m4) | ((w >> (4 * k)) & m4) << 32;
    w = (w & m2) | ((w >> (2 * k)) & m2) << 16;
    return (w & m1) | ((w >> k) & m1) << 8;
}

/* Code j of a group of 8 k-bit codes, LSB-first, from the group's k bytes in w. */
#define ZL_CODE(w, j, k) ((unsigned)((w) >> ((j) * (k))) & ((1u << (k)) - 1u))

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define ZL_LITTLE_ENDIAN 1
#else
#define ZL_LITTLE_ENDIAN 0
#endif

/* The len (<= 8) bytes at src as a little-endian integer. */
static inline uint64_t load_le(const uint8_t *src, unsigned len) {
    uint64_t w = 0;
    for (unsigned b = 0; b < len; b++) w |= (uint64_t)src[b] << (8 * b);
    return w;
}

/* The same, reading 8 bytes (the caller guarantees they are in bounds): one load on a
 * little-endian machine; the bits above 8 * len are garbage the caller masks off. */
static inline uint64_t load8_le(const uint8_t *src, unsigned len) {
#if ZL_LITTLE_ENDIAN
    (void)len;
    uint64_t w;
    memcpy(&w, src, 8);
    return w;
#else
    return load_le(src, len);
#endif
}

static inline void store8_le(uint8_t *out, uint64_t v) {
#if ZL_LITTLE_ENDIAN
    memcpy(out, &v, 8);
#else
    for (unsigned j = 0; j < 8; j++) out[j] = (uint8_t)(v >> (8 * j));
#endif
}

/* k is a constant in each call site (the switch below), so the loops unroll. */
static inline void unpack(unsigned k, size_t n, const uint8_t *restrict src,
                          const uint8_t *restrict table, uint8_t *restrict out) {
    size_t groups = n / 8;
    size_t wide = wide_groups(n, k);
    for (size_t g = 0; g < groups; g++) {
        uint64_t codes = spread(g < wide ? load8_le(src + g * k, k) : load_le(src + g * k, k), k);
        uint8_t *o = out + 8 * g;
        for (unsigned j = 0; j < 8; j++) o[j] = table[(uint8_t)(codes >> (8 * j))];
    }
    size_t rest = n - 8 * groups;
    if (rest) {
        unsigned tail = (unsigned)((rest * k + 7) / 8);
        uint64_t w = load_le(src + groups * k, tail);
        for (unsigned j = 0; j < rest; j++) out[8 * groups + j] = table[ZL_CODE(w, j, k)];
    }
}

static unsigned free_bits(uint8_t mask) {
    unsigned k = 8;
    for (; mask; mask &= (uint8_t)(mask - 1)) k--;
    return k;
}

/* The common case: the free bits are contiguous (bits lo..lo+k-1; bfloat16's low plane
 * frees bits 0..6). A group of 8 codes becomes 8 bytes with shifts and masks in one
 * 64-bit register, no table. */
static inline void unpack_run(unsigned k, unsigned lo, uint8_t value, size_t n,
                              const uint8_t *restrict src, uint8_t *restrict out) {
    const uint64_t fill = 0x0101010101010101ull * value;
    size_t groups = n / 8;
    size_t wide = wide_groups(n, k);
    for (size_t g = 0; g < groups; g++) {
        uint64_t w = g < wide ? load8_le(src + g * k, k) : load_le(src + g * k, k);
        store8_le(out + 8 * g, (spread(w, k) << lo) | fill);
    }
    size_t rest = n - 8 * groups;
    if (rest) {
        uint64_t w = load_le(src + groups * k, (unsigned)((rest * k + 7) / 8));
        for (unsigned j = 0; j < rest; j++)
            out[8 * groups + j] = (uint8_t)((ZL_CODE(w, j, k) << lo) | value);
    }
}

#define ZL_UNPACK_CASE(K)                            \
    case K:                                          \
        if (run)                                     \
            unpack_run(K, lo, value, n, src + 2, out); \
        else                                         \
            unpack(K, n, src + 2, table, out);       \
        break;

size_t zl_bitpack_size(size_t n, uint8_t mask) {
    unsigned k = free_bits(mask);
    return 2 + (n / 8) * k + ((n % 8) * k + 7) / 8;
}

static int check(size_t n, const uint8_t *src, size_t src_len) {
    if (!src) return ZL_ERR_NULL;
    if (src_len < 2) return ZL_ERR_SIZE;
    uint8_t mask = src[0], value = src[1];
    if (mask == 0 || mask == 0xFF || (value & (uint8_t)~mask)) return ZL_ERR_DATA;
    if (src_len != zl_bitpack_size(n, mask)) return ZL_ERR_SIZE;
    return ZL_OK;
}

int zl_unpack_bits(size_t n, const uint8_t *src, size_t src_len, uint8_t *out) {
    int status = check(n, src, src_len);
    if (status != ZL_OK || !out || n == 0) return status;
    uint8_t mask = src[0], value = src[1];
    unsigned k = free_bits(mask), lo = 0;
    while (mask >> lo & 1u) lo++;
    /* run: the free bits are exactly lo..lo+k-1 */
    int run = (uint8_t)~mask == (uint8_t)(((1u << k) - 1u) << lo);
    /* table[code] (other masks): the code's k bits deposited, lowest first, into the
     * bits mask leaves free, the constant bits added. */
    uint8_t table[128];
    for (unsigned code = 0; !run && code < (1u << k); code++) {
        unsigned byte = value, c = code;
        for (unsigned bit = 0; bit < 8; bit++) {
            if (!(mask >> bit & 1u)) {
                byte |= (c & 1u) << bit;
                c >>= 1;
            }
        }
        table[code] = (uint8_t)byte;
    }
    switch (k) {
        ZL_UNPACK_CASE(1)
        ZL_UNPACK_CASE(2)
        ZL_UNPACK_CASE(3)
        ZL_UNPACK_CASE(4)
        ZL_UNPACK_CASE(5)
        ZL_UNPACK_CASE(6)
        ZL_UNPACK_CASE(7)
    }
    return ZL_OK;
}
