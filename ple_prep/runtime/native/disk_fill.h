/* Read-ahead's reads into a disk reader's host cache (disk_fill.c), for readahead.c: a request's
 * rows read with the reader's AIO context, buffer and worker (disk_reads.h). */
#ifndef PLE_PREP_DISK_FILL_H
#define PLE_PREP_DISK_FILL_H
#include "disk_reads.h"

/* The rows of a request's coming chunks, each block's rows adjacent, blocks in the order wanted. */
typedef struct {
    const int64_t *slots;
    Py_ssize_t count;
    Py_ssize_t page_size, rows_per_page, row_bytes;
    /* The cache's pins, with those of the rows in flight, stay within it (a fill's first read excepted). */
    int64_t pin_limit;
    /* Asked before each read is queued: nonzero stops the queueing (the reads in flight still land). */
    int (*stopped)(void *owner);
    /* Told after each batch of reads lands: every row before `done` is admitted, found cached or dropped. */
    void (*moved)(void *owner, Py_ssize_t done);
    void *owner;
} fill_request;

/* Why a fill returned: every row handled, `stopped`, or the next read would pass pin_limit. */
#define FILL_DONE 0
#define FILL_STOPPED 1
#define FILL_PINS 2

typedef struct {
    Py_ssize_t done;      /* rows before it handled (start included) */
    Py_ssize_t rows_read, rows_found, pages_read;
    int reason;           /* a FILL_ value */
} fill_result;

/* The rows from `start` on: those the cache holds are marked referenced and passed over, the blocks
 * of the others read, `depth` in flight from the first read to the last, and their rows admitted
 * pinned as each block lands (rows cached meanwhile left as they are). Without the GIL; takes the
 * cache's lock for each batch of reads queued and landed, never while it waits for the disk.
 * With the reader's page sums (disk_reader_check_sums) a block whose page differs is not admitted.
 * Returns 0 or an errno (SHORT_READ, STALLED, BAD_SUM) with *failed_at, as disk_reader_stage. */
int disk_reader_fill(disk_reader *reader, const fill_request *request, Py_ssize_t start, fill_result *result,
                     off_t *failed_at);

#endif
