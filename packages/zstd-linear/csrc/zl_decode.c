/* Chunk decode: a weight's chunks, frames to values, in one call without the GIL, and the
 * read-ahead hint for their frames (see zstd_linear.h). */
#define _POSIX_C_SOURCE 200112L /* posix_madvise, sysconf under -std=c11 */
#define _DEFAULT_SOURCE /* madvise and MADV_PAGEOUT (zl_page_out) */
#include "zstd_linear.h"

#include <errno.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define ZL_HAVE_MADVISE 1
#endif

/* Decode frame f into dst (n bytes); *detail as zl_decode_chunks. */
static int decode_frame(const zl_zstd *zstd, void *dctx, const zl_frame *f, uint8_t *dst,
                        size_t n, size_t *detail) {
    if (!f->data && f->size) return ZL_ERR_NULL;
    switch (f->kind) {
        case ZL_FRAME_ZSTD: {
            size_t got = zstd->decompress(dctx, dst, n, f->data, f->size);
            if (zstd->is_error(got) || got != n) {
                *detail = got;
                return ZL_ERR_FRAME;
            }
            return ZL_OK;
        }
        case ZL_FRAME_RAW:
            if (f->size != n) {
                *detail = f->size;
                return ZL_ERR_FRAME;
            }
            if (n) memcpy(dst, f->data, n);
            return ZL_OK;
        case ZL_FRAME_BITPACK:
            return zl_unpack_bits(n, f->data, f->size, dst);
        default:
            return ZL_ERR_DATA;
    }
}

static int decode_chunk(const zl_zstd *zstd, void *dctx, int width, int planes, int rotation,
                        const zl_chunk *chunk, uint8_t *dst, uint8_t *scratch,
                        size_t scratch_size, size_t *detail) {
    size_t n = chunk->n;
    if (!planes) return decode_frame(zstd, dctx, &chunk->frames[0], dst, n * (size_t)width, detail);
    if ((size_t)width * n > scratch_size) return ZL_ERR_SIZE;
    const uint8_t *p[4] = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < width; i++) {
        const zl_frame *f = &chunk->frames[i];
        if (f->kind == ZL_FRAME_RAW) {
            if (f->size != n) {
                *detail = f->size;
                return ZL_ERR_FRAME;
            }
            p[i] = n ? f->data : scratch; /* joined straight from the frame */
            continue;
        }
        uint8_t *plane = scratch + (size_t)i * n;
        int status = decode_frame(zstd, dctx, f, plane, n, detail);
        if (status != ZL_OK) return status;
        p[i] = plane;
    }
    return zl_join(width, rotation, n, p[0], p[1], p[2], p[3], dst);
}

int zl_decode_chunks(const zl_zstd *zstd, void *dctx, int width, int planes, int rotation,
                     const zl_chunk *chunks, size_t count, uint8_t *out, size_t origin,
                     size_t out_size, uint8_t *scratch, size_t scratch_size, size_t *failed,
                     size_t *detail) {
    if (!failed || !detail) return ZL_ERR_NULL;
    *failed = 0;
    *detail = 0;
    if (width != 2 && width != 4) return ZL_ERR_WIDTH;
    if (rotation < 0 || rotation >= 8 * width) return ZL_ERR_ROTATION;
    if (count && (!zstd || !zstd->decompress || !zstd->is_error || !chunks || !out))
        return ZL_ERR_NULL;
    for (size_t i = 0; i < count; i++) {
        const zl_chunk *chunk = &chunks[i];
        size_t bytes = chunk->n * (size_t)width;
        int status;
        *failed = i;
        if (chunk->n > SIZE_MAX / (size_t)width || chunk->offset < origin ||
            chunk->offset - origin > out_size || bytes > out_size - (chunk->offset - origin))
            return ZL_ERR_SIZE;
        if (planes && !scratch) return ZL_ERR_NULL;
        status = decode_chunk(zstd, dctx, width, planes, rotation, chunk,
                              out + (chunk->offset - origin), scratch, scratch_size, detail);
        if (status != ZL_OK) return status;
    }
    *failed = count;
    return ZL_OK;
}

int zl_will_need(const void *addr, size_t len) {
#ifdef ZL_HAVE_MADVISE
    long page = sysconf(_SC_PAGESIZE);
    if (!addr || !len || page <= 0) return 0;
    uintptr_t start = (uintptr_t)addr & ~((uintptr_t)page - 1);
    return posix_madvise((void *)start, len + ((uintptr_t)addr - start), POSIX_MADV_WILLNEED);
#else
    (void)addr;
    (void)len;
    return 0;
#endif
}

int zl_page_out(const void *addr, size_t len) {
#if defined(ZL_HAVE_MADVISE) && defined(MADV_PAGEOUT)
    long page = sysconf(_SC_PAGESIZE);
    if (!addr || !len || page <= 0) return 0;
    uintptr_t mask = (uintptr_t)page - 1;
    uintptr_t start = ((uintptr_t)addr + mask) & ~mask;      /* first whole page */
    uintptr_t stop = ((uintptr_t)addr + len) & ~mask;        /* past the last whole page */
    if (stop <= start) return 0;
    return madvise((void *)start, stop - start, MADV_PAGEOUT) == 0 ? 0 : errno;
#else
    (void)addr;
    (void)len;
    return ZL_ERR_UNSUPPORTED;
#endif
}
