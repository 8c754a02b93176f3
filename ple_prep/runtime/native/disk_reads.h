/* A step's cold disk-tier rows read by the step service's own thread (disk_reads.c): no GIL, so
 * that no Python thread (one holding the GIL while it waits for the device) can stall a step.
 * Read-ahead reads on a reader of its own the same way (disk_fill.h). */
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
    Py_ssize_t page_size;
    const uint32_t *page_sums; /* the table's page sums (format/pagesums.py) each read is checked against, or NULL */
    Py_ssize_t sum_pages;      /* their count: the table's pages */
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

/* Reads a reader keeps in flight at most. */
#define MAX_DEPTH 512

/* disk_reader_stage's result for a read that ended before its block did, inside the table. */
#define SHORT_READ (-1)
/* Its result for a wait of `timeout` in which no read completed: the disk stalled. */
#define STALLED (-2)
/* Its result for a block with a page whose sum is not the table's: the disk returned other bytes. */
#define BAD_SUM (-3)

/* 0, or -1 with errno (the reader then holds nothing); `capacity` positions a step at most; reads
 * that make no progress for `timeout` seconds fail their step. */
int disk_reader_open(disk_reader *reader, int fd, off_t data_offset, off_t file_end, Py_ssize_t page_size,
                     Py_ssize_t capacity, int depth, double timeout);
void disk_reader_close(disk_reader *reader);
/* Read with the worker, one pread at a time, from now on: the caller knows (the table's reader
 * probed it, runtime/direct.py) that the file system completes O_DIRECT reads inside io_submit. */
void disk_reader_use_worker(disk_reader *reader);

/* Check each block read against `sums` (uint32, one a page of the table's `pages`; kept alive by the
 * caller while the reader is open): a block with a page whose sum differs fails its step (BAD_SUM)
 * and none of its rows is staged or admitted. */
void disk_reader_check_sums(disk_reader *reader, const uint32_t *sums, Py_ssize_t pages);

/* The rows of the request's disk positions (slots >= num_resident, already found by stage) staged
 * into the last `disk` rows of `out`, in position order, their index entries set: from the host
 * cache where it holds them (reader->cache), the others read from the file, each block once, and
 * admitted into the cache as their block lands; returns 0, or an errno (SHORT_READ: the file shrank;
 * STALLED: the disk stalled; BAD_SUM: a page read back other bytes) with *failed_at the file offset
 * that failed (for STALLED, one of the reads waited for; for BAD_SUM, the page's). */
int disk_reader_stage(disk_reader *reader, stage_call *call, Py_ssize_t disk, off_t *failed_at);

/* For the other users of a reader (disk_fill.c): the block at `offset` read by the worker into
 * its buffer (0 with *result, bytes or -errno; an errno where no worker can be made; STALLED, the
 * worker then abandoned to its read); a block's read result checked (0, an errno or SHORT_READ);
 * a read block's pages (those of the table's pages it holds, at `data`, read from `offset`) against
 * the sums disk_reader_check_sums gave (0, or BAD_SUM with *bad_at the first differing page's offset);
 * the block that read landed in; the AIO context and buffer left to the reads in flight, new ones taken (the buffer NULL where
 * memory is refused; the context 0 where the kernel refuses one: the worker reads then). */
int disk_reader_worker_read(disk_reader *reader, off_t offset, long *result);
const char *disk_reader_worker_block(const disk_reader *reader); /* the block the worker's last read read */
int disk_reader_checked(const disk_reader *reader, long result, off_t offset);
int disk_reader_sums_match(const disk_reader *reader, const char *data, off_t offset, off_t *bad_at);
void disk_reader_abandon(disk_reader *reader);

#endif
