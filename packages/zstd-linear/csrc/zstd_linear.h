/* The zstd-linear C core: joining byte planes back into float bit patterns, and
 * unpacking bit-packed planes.
 *
 * A chunk of E values of width n bytes (n = 2 or 4) is stored as n planes of E bytes:
 * plane p holds byte p (little-endian) of each value after the value was rotated left
 * by k bits. Joining writes, for every i,
 *
 *     out[i] = rotr(planes[0][i] | planes[1][i] << 8 | ... , k)     (n bytes, little-endian)
 *
 * The declarations between the cdef markers are what cffi sees (csrc/ffi_build.py).
 */
#ifndef ZSTD_LINEAR_H
#define ZSTD_LINEAR_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
#define ZL_OK 0
#define ZL_ERR_WIDTH -1
#define ZL_ERR_ROTATION -2
#define ZL_ERR_NULL -3
#define ZL_ERR_SIZE -4
#define ZL_ERR_DATA -5

/* Join 2 (p2, p3 NULL) or 4 planes of n bytes each into out (n * width bytes).
 * rotation: 0 <= rotation < 8 * width. Planes and out must not overlap.
 * Returns ZL_OK or a ZL_ERR_* code (nothing is written then). */
int zl_join(int width, int rotation, size_t n, const uint8_t *p0, const uint8_t *p1,
            const uint8_t *p2, const uint8_t *p3, uint8_t *out);

/* A bit-packed plane of n bytes: src = [mask, value, codes...]. The bits set in mask are
 * the same in every byte (their values in value); the k = 8 - popcount(mask) others
 * (1..7; a constant plane keeps bit 7, so that no frame expands more than 8x) are
 * stored as one k-bit code per byte, the byte's free bits lowest first, codes packed
 * LSB-first into zl_bitpack_size(n, mask) - 2 bytes. */
size_t zl_bitpack_size(size_t n, uint8_t mask);

/* Unpack such a plane into out (n bytes). Returns ZL_OK, ZL_ERR_SIZE (src_len is not
 * zl_bitpack_size(n, src[0])), ZL_ERR_DATA (mask 0 or 0xFF, or value has bits outside
 * mask) or ZL_ERR_NULL (src NULL); nothing is written unless ZL_OK. With out NULL it
 * only checks src and writes nothing. */
int zl_unpack_bits(size_t n, const uint8_t *src, size_t src_len, uint8_t *out);

/* "C<standard> sha256:<digest of the compiled sources>" */
const char *zl_core_info(void);
/* cdef-end */

#endif
