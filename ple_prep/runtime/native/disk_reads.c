/* The step service's cold reads (disk_reads.h): the distinct blocks of a step's disk rows read with
 * Linux native AIO on the table's O_DIRECT descriptor, `depth` in flight (at most MAX_DEPTH), each block's rows copied
 * to their staging rows as it lands; where the kernel refuses AIO or completes O_DIRECT reads inside
 * io_submit (FUSE, some network file systems), one pread at a time on a worker thread. As the
 * runtime's DirectReader (runtime/direct.py) reads a request, but on the service's thread and
 * without the GIL: a Python thread that holds it while it waits for the device (a synchronous copy
 * back, a full launch queue) would otherwise wait for a step that waits for it.
 *
 * A wait in which no read completes for `timeout` fails the step (STALLED) instead of hanging the
 * service and the device that waits for it. Nothing can cancel a read in the kernel (io_cancel does
 * not apply to file reads, io_destroy waits for them, a pread cannot be interrupted), so its buffer
 * is abandoned to it: an AIO context and its buffer are left to their reads (never freed, never
 * read from again) and the next step gets new ones; a worker whose pread outlived the timeout frees
 * itself once the pread returns, and the next read gets a new worker. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../../core/native/pagesums.h"
#include "../../core/native/rows.h"
#include "disk_reads.h"

#define MIN_BLOCK 4096
/* Low bits of a key hold the position's rank among the step's disk positions. */
#define RANK_BITS 24
/* How far ahead of the position looked up in the host cache its words are fetched. */
#define PREFETCH_SLOTS 16

/* The pread path's reading thread: one block at a time into its own buffer, from its own
 * descriptor (a dup: the table's may be closed and its number reused while an abandoned read is
 * still in the kernel). */
typedef struct read_worker {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int fd;
    char *buffer;
    size_t length;
    off_t offset;
    int job, done, abandoned, stopping;
    long result; /* bytes read, or -errno */
    pthread_t thread;
} read_worker;

static void free_worker(read_worker *worker)
{
    if (worker->fd >= 0)
        close(worker->fd);
    free(worker->buffer);
    pthread_cond_destroy(&worker->changed);
    pthread_mutex_destroy(&worker->lock);
    free(worker);
}

static void *worker_main(void *argument)
{
    read_worker *worker = argument;
    pthread_mutex_lock(&worker->lock);
    for (;;) {
        while (!worker->job && !worker->stopping)
            pthread_cond_wait(&worker->changed, &worker->lock);
        if (worker->stopping)
            break;
        worker->job = 0;
        pthread_mutex_unlock(&worker->lock);
        ssize_t got;
        do
            got = pread(worker->fd, worker->buffer, worker->length, worker->offset);
        while (got < 0 && errno == EINTR);
        long result = got < 0 ? -errno : (long)got;
        pthread_mutex_lock(&worker->lock);
        worker->result = result;
        worker->done = 1;
        if (worker->abandoned)
            break;
        pthread_cond_broadcast(&worker->changed);
    }
    int abandoned = worker->abandoned;
    pthread_mutex_unlock(&worker->lock);
    if (abandoned) /* detached by the reader that gave up on it */
        free_worker(worker);
    return NULL;
}

static read_worker *new_worker(const disk_reader *reader)
{
    read_worker *worker = calloc(1, sizeof(read_worker));
    if (!worker)
        return NULL;
    worker->fd = -1;
    void *buffer = NULL;
    pthread_condattr_t clock;
    pthread_condattr_init(&clock);
    pthread_condattr_setclock(&clock, CLOCK_MONOTONIC);
    pthread_mutex_init(&worker->lock, NULL);
    pthread_cond_init(&worker->changed, &clock);
    pthread_condattr_destroy(&clock);
    if (posix_memalign(&buffer, (size_t)reader->block, (size_t)reader->block) != 0) {
        free_worker(worker);
        errno = ENOMEM;
        return NULL;
    }
    worker->buffer = buffer;
    worker->length = (size_t)reader->block;
    worker->fd = fcntl(reader->fd, F_DUPFD_CLOEXEC, 0);
    int error = worker->fd < 0 ? errno : pthread_create(&worker->thread, NULL, worker_main, worker);
    if (error) {
        free_worker(worker);
        errno = error;
        return NULL;
    }
    return worker;
}

static void stop_worker(read_worker *worker)
{
    pthread_mutex_lock(&worker->lock);
    worker->stopping = 1;
    pthread_cond_broadcast(&worker->changed);
    pthread_mutex_unlock(&worker->lock);
    pthread_join(worker->thread, NULL);
    free_worker(worker);
}

static void deadline_after(struct timespec *deadline, const struct timespec *timeout)
{
    clock_gettime(CLOCK_MONOTONIC, deadline);
    deadline->tv_sec += timeout->tv_sec;
    deadline->tv_nsec += timeout->tv_nsec;
    if (deadline->tv_nsec >= 1000000000L) {
        deadline->tv_sec++;
        deadline->tv_nsec -= 1000000000L;
    }
}

/* The block at `offset` read by the worker into its buffer: 0 with *result (bytes or -errno), an
 * errno where no worker can be made, or STALLED where the read outlived the timeout (the worker is
 * then abandoned to it). */
int disk_reader_worker_read(disk_reader *reader, off_t offset, long *result)
{
    if (!reader->worker && !(reader->worker = new_worker(reader)))
        return errno ? errno : ENOMEM;
    read_worker *worker = reader->worker;
    struct timespec deadline;
    deadline_after(&deadline, &reader->timeout);
    pthread_mutex_lock(&worker->lock);
    worker->offset = offset;
    worker->done = 0;
    worker->job = 1;
    pthread_cond_broadcast(&worker->changed);
    while (!worker->done) {
        if (pthread_cond_timedwait(&worker->changed, &worker->lock, &deadline) == ETIMEDOUT && !worker->done) {
            worker->abandoned = 1;
            pthread_t thread = worker->thread;
            pthread_mutex_unlock(&worker->lock);
            pthread_detach(thread);
            reader->worker = NULL;
            return STALLED;
        }
    }
    *result = worker->result;
    pthread_mutex_unlock(&worker->lock);
    return 0;
}

const char *disk_reader_worker_block(const disk_reader *reader)
{
    return reader->worker->buffer;
}

/* Leave the AIO context and buffer to the reads still in flight (never freed: the kernel may still
 * write into the buffer) and take new ones; without them, the worker's preads. */
void disk_reader_abandon(disk_reader *reader)
{
    void *buffer = NULL;
    aio_context_t context = 0;
    reader->context = 0;
    if (posix_memalign(&buffer, (size_t)reader->block, (size_t)reader->block * (size_t)reader->depth) != 0) {
        reader->buffer = NULL;
        return;
    }
    reader->buffer = buffer;
    if (syscall(SYS_io_setup, reader->depth, &context) == 0)
        reader->context = context;
}

int disk_reader_open(disk_reader *reader, int fd, off_t data_offset, off_t file_end, Py_ssize_t page_size,
                     Py_ssize_t capacity, int depth, double timeout)
{
    depth = depth < MAX_DEPTH ? depth : MAX_DEPTH;
    *reader = (disk_reader){.fd = fd, .data_offset = data_offset, .file_end = file_end, .depth = depth};
    if (!(timeout > 0 && timeout < 1e9)) {
        errno = EINVAL;
        return -1;
    }
    reader->timeout.tv_sec = (time_t)timeout;
    reader->timeout.tv_nsec = (long)((timeout - (double)reader->timeout.tv_sec) * 1e9);
    reader->block = page_size > MIN_BLOCK ? page_size : MIN_BLOCK;
    reader->page_size = page_size;
    if (capacity >= (1 << RANK_BITS) || depth < 1) {
        errno = EINVAL;
        return -1;
    }
    void *buffer = NULL;
    if (posix_memalign(&buffer, (size_t)reader->block, (size_t)reader->block * (size_t)depth) != 0) {
        errno = ENOMEM;
        return -1;
    }
    reader->buffer = buffer;
    reader->keys = malloc(sizeof(uint64_t) * (size_t)(capacity + 1));
    reader->positions = malloc(sizeof(int64_t) * (size_t)(capacity + 1));
    if (!reader->keys || !reader->positions) {
        disk_reader_close(reader);
        errno = ENOMEM;
        return -1;
    }
    aio_context_t context = 0;
    if (syscall(SYS_io_setup, depth, &context) == 0)
        reader->context = context;
    return 0;
}

void disk_reader_use_worker(disk_reader *reader)
{
    if (reader->context)
        syscall(SYS_io_destroy, (aio_context_t)reader->context);
    reader->context = 0;
}

void disk_reader_close(disk_reader *reader)
{
    if (reader->worker)
        stop_worker(reader->worker);
    if (reader->context)
        syscall(SYS_io_destroy, (aio_context_t)reader->context);
    free(reader->buffer);
    free(reader->keys);
    free(reader->positions);
    *reader = (disk_reader){.fd = -1};
}

static int compare_keys(const void *left, const void *right)
{
    uint64_t a = *(const uint64_t *)left, b = *(const uint64_t *)right;
    return a < b ? -1 : a > b;
}

/* The file offset of a slot's row. */
static off_t row_offset(const disk_reader *reader, const stage_request *request, int64_t slot)
{
    return reader->data_offset + (off_t)(slot / request->rows_per_page) * request->page_size
           + (off_t)(slot % request->rows_per_page) * request->row_bytes;
}

/* A block's read result checked: 0, an errno, or SHORT_READ. A block may end past the file only
 * at the table's end. */
int disk_reader_checked(const disk_reader *reader, long result, off_t offset)
{
    if (result < 0)
        return (int)-result;
    if (result < reader->block && offset + result < reader->file_end)
        return SHORT_READ;
    return 0;
}

void disk_reader_check_sums(disk_reader *reader, const uint32_t *sums, Py_ssize_t pages)
{
    reader->page_sums = sums;
    reader->sum_pages = pages;
}

int disk_reader_sums_match(const disk_reader *reader, const char *data, off_t offset, off_t *bad_at)
{
    if (!reader->page_sums)
        return 0;
    for (Py_ssize_t at = 0; at < reader->block; at += reader->page_size) {
        off_t page_offset = offset + (off_t)at;
        if (page_offset < reader->data_offset)
            continue;
        Py_ssize_t page = (Py_ssize_t)((page_offset - reader->data_offset) / reader->page_size);
        if (page >= reader->sum_pages)
            break;
        if ((uint32_t)xxh64_stripes((const unsigned char *)data + at, (size_t)reader->page_size) != reader->page_sums[page]) {
            *bad_at = page_offset;
            return BAD_SUM;
        }
    }
    return 0;
}

/* Copy the rows of keys [from, to) (one block, at `data`) to their staging rows, and admit them
 * into the host cache (whose lock the caller holds). */
static void copy_block(const disk_reader *reader, stage_call *call, Py_ssize_t first, Py_ssize_t from,
                       Py_ssize_t to, const char *data, off_t block_offset)
{
    stage_request *request = &call->request;
    for (Py_ssize_t k = from; k < to; k++) {
        Py_ssize_t rank = (Py_ssize_t)(reader->keys[k] & ((1u << RANK_BITS) - 1));
        int64_t position = reader->positions[rank];
        int64_t slot = request->slots[position];
        const char *row = data + (row_offset(reader, request, slot) - block_offset);
        memcpy(request->out + (first + rank) * request->row_bytes, row, (size_t)request->row_bytes);
        request->index[position] = (int32_t)(request->num_resident + first + rank);
        if (reader->cache)
            host_cache_insert(reader->cache, slot, row);
    }
}

static void lock_cache(const disk_reader *reader)
{
    if (reader->cache)
        host_cache_lock(reader->cache);
}

static void unlock_cache(const disk_reader *reader)
{
    if (reader->cache)
        host_cache_unlock(reader->cache);
}

/* The step's disk positions by rank (reader->positions), each staged from the host cache where it
 * holds the slot (under its lock: no entry changes while its row is copied out), the others' keys
 * (block, rank) sorted into reader->keys: returns their count. */
static Py_ssize_t collect(disk_reader *reader, stage_call *call, Py_ssize_t first, Py_ssize_t disk)
{
    stage_request *request = &call->request;
    Py_ssize_t found = 0, missed = 0;
    reader->cache_hits = reader->read_ahead_hits = 0;
    lock_cache(reader);
    for (Py_ssize_t i = 0; i < request->count && found < disk; i++) {
        int64_t slot = request->slots[i];
        /* The cache is far larger than the CPU's: its words are fetched ahead, not waited for in turn. */
        if (reader->cache && i + PREFETCH_SLOTS < request->count)
            host_cache_prefetch(reader->cache, request->slots[i + PREFETCH_SLOTS]);
        if (slot < request->num_resident)
            continue;
        reader->positions[found] = i;
        int pinned = 0;
        if (reader->cache && host_cache_copy(reader->cache, slot, request->out + (first + found) * request->row_bytes,
                                             &pinned)) {
            request->index[i] = (int32_t)(request->num_resident + first + found);
            reader->cache_hits++;
            reader->read_ahead_hits += pinned;
        } else {
            uint64_t block = (uint64_t)(row_offset(reader, request, slot) / reader->block);
            reader->keys[missed++] = (block << RANK_BITS) | (uint64_t)found;
        }
        found++;
    }
    unlock_cache(reader);
    qsort(reader->keys, (size_t)missed, sizeof(uint64_t), compare_keys);
    return missed;
}

int disk_reader_stage(disk_reader *reader, stage_call *call, Py_ssize_t disk, off_t *failed_at)
{
    Py_ssize_t first = call->out_rows - disk, found = collect(reader, call, first, disk);
    /* The keys of one block are a run; runs are read in order, `depth` blocks in flight, each in a
     * buffer slot that holds it until its rows are copied. */
    Py_ssize_t next = 0; /* first key of the next block to submit */
    int in_flight = 0, error = 0;
    struct iocb iocbs[MAX_DEPTH], *pointers[MAX_DEPTH];
    Py_ssize_t run_from[MAX_DEPTH], run_to[MAX_DEPTH];
    off_t in_flight_at[MAX_DEPTH];
    int depth = reader->depth < MAX_DEPTH ? reader->depth : MAX_DEPTH;
    int free_slots[MAX_DEPTH], free_count = depth;
    for (int s = 0; s < depth; s++)
        free_slots[s] = s;
    while ((next < found && !error) || in_flight > 0) {
        int batch = 0;
        while (next < found && !error && free_count > 0) {
            uint64_t block = reader->keys[next] >> RANK_BITS;
            Py_ssize_t end = next + 1;
            while (end < found && (reader->keys[end] >> RANK_BITS) == block)
                end++;
            int s = free_slots[--free_count];
            run_from[s] = next;
            run_to[s] = end;
            off_t offset = (off_t)block * reader->block;
            char *data = reader->buffer + (size_t)s * (size_t)reader->block;
            in_flight_at[s] = offset;
            if (!reader->context) {
                long got = 0;
                error = disk_reader_worker_read(reader, offset, &got);
                error = error ? error : disk_reader_checked(reader, got, offset);
                reader->blocks_read++;
                off_t failed_offset = offset;
                if (!error)
                    error = disk_reader_sums_match(reader, reader->worker->buffer, offset, &failed_offset);
                if (error) {
                    *failed_at = failed_offset;
                } else {
                    lock_cache(reader);
                    copy_block(reader, call, first, next, end, reader->worker->buffer, offset);
                    unlock_cache(reader);
                }
                free_slots[free_count++] = s;
            } else {
                iocbs[batch] = (struct iocb){.aio_data = (uint64_t)s, .aio_lio_opcode = IOCB_CMD_PREAD,
                                             .aio_fildes = (uint32_t)reader->fd, .aio_buf = (uint64_t)(uintptr_t)data,
                                             .aio_nbytes = (uint64_t)reader->block, .aio_offset = offset};
                pointers[batch] = &iocbs[batch];
                batch++;
            }
            next = end;
        }
        int sent = 0;
        while (sent < batch) {
            long taken = syscall(SYS_io_submit, (aio_context_t)reader->context, (long)(batch - sent), pointers + sent);
            if (taken <= 0) {
                if (taken < 0 && errno == EINTR)
                    continue;
                error = taken < 0 ? errno : EIO;
                *failed_at = (off_t)iocbs[sent].aio_offset;
                for (int k = sent; k < batch; k++)
                    free_slots[free_count++] = (int)iocbs[k].aio_data;
                break;
            }
            sent += (int)taken;
            in_flight += (int)taken;
        }
        if (in_flight == 0)
            continue;
        struct io_event events[MAX_DEPTH];
        struct timespec timeout = reader->timeout;
        long got = syscall(SYS_io_getevents, (aio_context_t)reader->context, 1L, (long)in_flight, events, &timeout);
        if (got <= 0) {
            if (got < 0 && errno == EINTR)
                continue;
            /* The reads in flight still target the buffer: it is theirs, the step fails. */
            error = got < 0 ? errno : STALLED;
            *failed_at = 0;
            for (int k = 0; k < free_count; k++)
                in_flight_at[free_slots[k]] = -1;
            for (int k = 0; k < depth && got == 0; k++)
                if (in_flight_at[k] >= 0) {
                    *failed_at = in_flight_at[k];
                    break;
                }
            disk_reader_abandon(reader);
            return error;
        }
        /* Each landed block checked (its page sums too) before the cache's lock is taken for the copies. */
        int outcome[MAX_DEPTH];
        off_t block_at[MAX_DEPTH], bad_at[MAX_DEPTH];
        for (long e = 0; e < got; e++) {
            int s = (int)events[e].data;
            block_at[e] = bad_at[e] = (off_t)((reader->keys[run_from[s]] >> RANK_BITS) * (uint64_t)reader->block);
            outcome[e] = disk_reader_checked(reader, (long)events[e].res, block_at[e]);
            if (!outcome[e])
                outcome[e] = disk_reader_sums_match(reader, reader->buffer + (size_t)s * (size_t)reader->block,
                                                    block_at[e], &bad_at[e]);
        }
        lock_cache(reader);
        for (long e = 0; e < got; e++) {
            int s = (int)events[e].data;
            if (outcome[e] && !error) {
                error = outcome[e];
                *failed_at = bad_at[e];
            }
            if (!outcome[e] && !error)
                copy_block(reader, call, first, run_from[s], run_to[s], reader->buffer + (size_t)s * (size_t)reader->block,
                           block_at[e]);
            free_slots[free_count++] = s;
        }
        unlock_cache(reader);
        in_flight -= (int)got;
        reader->blocks_read += (uint64_t)got;
    }
    return error;
}
