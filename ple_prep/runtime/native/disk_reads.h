/* A step's cold disk-tier rows read by the step service's own thread (disk_reads.c): no GIL, so
 * that no Python thread (one holding the GIL while it waits for the device) can stall a step. */
#ifndef PLE_PREP_DISK_READS_H
#define PLE_PREP_DISK_READS_H
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "hostcache.h"
#include "stage.h"

typedef struct {
    int fd;                  /* the table file, O_DIRECT where the file system allows it */
    off_t data_offset, file_end;
    Py_ssize_t block;        /* bytes a read: max(page_size, 4096), aligned to it */
    int depth;               /* reads kept in flight */
    unsigned long context;   /* the thread's own Linux AIO context; 0: one pread at a time, on `worker` */
    char *buffer;            /* depth blocks, aligned to a block */
    struct timespec timeout; /* a wait with no read completing fails the step (STALLED) */
    struct read_worker *worker; /* the pread path's reading thread (made at the first pread) */
    uint64_t *keys;          /* (block, position) pairs of a step, sorted: capacity of them */
    int64_t *positions;      /* the step's disk positions */
    uint64_t blocks_read;    /* since the reader was opened */
    host_cache *cache;       /* the table's host cache (hostcache.h), or NULL */
    /* The last step's disk positions served by the host cache, and of those the ones read-ahead
     * had brought (pinned). */
    Py_ssize_t cache_hits, read_ahead_hits;
} disk_reader;

/* disk_reader_stage's result for a read that ended before its block did, inside the table. */
#define SHORT_READ (-1)
/* Its result for a wait of `timeout` in which no read completed: the disk stalled. */
#define STALLED (-2)

/* 0, or -1 with errno (the reader then holds nothing); `capacity` positions a step at most; reads
 * that make no progress for `timeout` seconds fail their step; `probe`: find out whether io_submit
 * completes reads itself (else the file system is known to serve AIO asynchronously). */
int disk_reader_open(disk_reader *reader, int fd, off_t data_offset, off_t file_end, Py_ssize_t page_size,
                     Py_ssize_t capacity, int depth, double timeout, int probe);
void disk_reader_close(disk_reader *reader);

/* The rows of the request's disk positions (slots >= num_resident, already found by stage) staged
 * into the last `disk` rows of `out`, in position order, their index entries set: from the host
 * cache where it holds them (reader->cache), the others read from the file, each block once, and
 * admitted into the cache as their block lands; returns 0, or an errno (SHORT_READ: the file shrank;
 * STALLED: the disk stalled) with *failed_at the file offset that failed (for STALLED, one of the
 * reads waited for). */
int disk_reader_stage(disk_reader *reader, stage_call *call, Py_ssize_t disk, off_t *failed_at);

/* Read-ahead's reads into the reader's host cache (readahead.c): rows of a request's coming chunks,
 * each block's rows adjacent, blocks in the order they are wanted. */
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
 * Returns 0 or an errno (SHORT_READ, STALLED) with *failed_at, as disk_reader_stage. */
int disk_reader_fill(disk_reader *reader, const fill_request *request, Py_ssize_t start, fill_result *result,
                     off_t *failed_at);

#endif
