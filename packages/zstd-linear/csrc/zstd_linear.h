/* The zstd-linear C core: joining byte planes back into float bit patterns, unpacking
 * bit-packed planes, and decoding whole chunks (frames -> planes -> values) in one call.
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

#define ZL_ERR_FRAME -6
#define ZL_ERR_UNSUPPORTED -7

/* Frame kinds, as numbered in the .zlin header (codec.FRAME_KINDS). */
#define ZL_FRAME_ZSTD 0
#define ZL_FRAME_RAW 1
#define ZL_FRAME_BITPACK 2

/* The two libzstd functions a chunk decode needs, handed in by the caller (the package
 * takes them from python-zstandard's bundled libzstd), so that the core is built without
 * zstd's headers or library: ZSTD_decompressDCtx and ZSTD_isError. */
typedef size_t (*zl_zstd_decompress_fn)(void *dctx, void *dst, size_t dst_capacity,
                                        const void *src, size_t src_size);
typedef unsigned (*zl_zstd_is_error_fn)(size_t code);

typedef struct {
    zl_zstd_decompress_fn decompress;
    zl_zstd_is_error_fn is_error;
} zl_zstd;

typedef struct {
    const uint8_t *data;
    size_t size;
    int kind; /* ZL_FRAME_* */
} zl_frame;

/* One chunk of a weight: n elements at byte offset `offset` of the weight, and its
 * frames: one per plane (frames[0..width-1]) when planes != 0, else frames[0] holds the
 * chunk's n * width bytes themselves. */
typedef struct {
    size_t offset;
    size_t n;
    zl_frame frames[4];
} zl_chunk;

/* Decode chunks[0..count-1] of one weight (element width 2 or 4 bytes, planar or not,
 * joined with `rotation` as zl_join) into out, which holds the weight's bytes from byte
 * `origin` on (out_size of them): chunk i goes to out + chunks[i].offset - origin.
 * zstd frames and bit-packed planes are decoded into scratch (scratch_size bytes, at
 * least width * n of the largest chunk); raw planes are joined from their data.
 *
 * Returns ZL_OK, or on the first chunk that fails, with *failed its index and *detail
 * what went wrong: ZL_ERR_FRAME (a zstd frame does not decode: *detail is zstd's error
 * code; or a frame decodes or holds the wrong number of bytes: *detail is that number),
 * ZL_ERR_SIZE (a chunk lies outside out, or scratch is too small), ZL_ERR_DATA (a
 * bit-packed frame is invalid, or an unknown kind), ZL_ERR_WIDTH / ZL_ERR_ROTATION /
 * ZL_ERR_NULL as zl_join. Chunks before *failed are decoded; later ones are not. */
int zl_decode_chunks(const zl_zstd *zstd, void *dctx, int width, int planes, int rotation,
                     const zl_chunk *chunks, size_t count, uint8_t *out, size_t origin,
                     size_t out_size, uint8_t *scratch, size_t scratch_size, size_t *failed,
                     size_t *detail);

/* Ask the kernel to read the pages of [addr, addr + len) (a file mapping) now, in the
 * background: posix_madvise(POSIX_MADV_WILLNEED) over the pages holding the range.
 * Returns 0, or the error posix_madvise returned (the read is only a hint; callers may
 * ignore it). A no-op returning 0 where there is no posix_madvise. */
int zl_will_need(const void *addr, size_t len);

/* Reclaim the pages wholly inside [addr, addr + len) (a file mapping) now: madvise(
 * MADV_PAGEOUT), which drops clean file pages from the page cache (Linux 5.4 and later).
 * The pages that hold the range's two ends are kept (a neighbour may still use them).
 * Returns 0, or the errno madvise set; ZL_ERR_UNSUPPORTED where the platform has no
 * MADV_PAGEOUT. Like zl_will_need, only advice: the bytes stay readable. */
int zl_page_out(const void *addr, size_t len);

/* "C<standard> sha256:<digest of the compiled sources>" */
const char *zl_core_info(void);
/* cdef-end */

#endif
