/* Read-ahead's reads (disk_fill.h): a request's rows read into the host cache, the reader's queue
 * kept `depth` deep from the first read to the last, each block's rows admitted pinned as it lands.
 * As disk_reader_stage reads a step (disk_reads.c), with the same timeout and failure handling: a
 * wait in which no read completes for the reader's timeout fails the fill (STALLED), its buffer
 * and context abandoned to the reads in flight. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/aio_abi.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "disk_fill.h"

/* A fill's reads: each buffer slot holds one run (a block's rows) from queueing until it lands. */
typedef struct {
    struct iocb iocbs[MAX_DEPTH], *pointers[MAX_DEPTH];
    struct io_event events[MAX_DEPTH];
    Py_ssize_t run_from[MAX_DEPTH], run_to[MAX_DEPTH], run_missing[MAX_DEPTH];
    off_t run_at[MAX_DEPTH], bad_at[MAX_DEPTH]; /* bad_at: where a landed block failed, by event */
    int outcome[MAX_DEPTH];                      /* and how (0: landed whole, its sums matched) */
    unsigned char busy[MAX_DEPTH];
    int depth, free_slots[MAX_DEPTH], free_count, queued[MAX_DEPTH], batch, in_flight;
    int64_t pending;        /* rows in flight, to be pinned when they land */
    Py_ssize_t failed_from; /* the first row of a run whose read failed (else the request's count) */
} fill_state;

static off_t fill_block_at(const disk_reader *reader, const fill_request *request, int64_t slot)
{
    off_t offset = reader->data_offset + (off_t)(slot / request->rows_per_page) * request->page_size
                   + (off_t)(slot % request->rows_per_page) * request->row_bytes;
    return offset / reader->block * reader->block;
}

/* Admit the rows of buffer slot s's run, landed at `data` (cache locked). */
static void fill_admit(const disk_reader *reader, const fill_request *request, fill_state *state, int s,
                       const char *data)
{
    for (Py_ssize_t k = state->run_from[s]; k < state->run_to[s]; k++) {
        int64_t slot = request->slots[k];
        off_t offset = reader->data_offset + (off_t)(slot / request->rows_per_page) * request->page_size
                       + (off_t)(slot % request->rows_per_page) * request->row_bytes;
        host_cache_insert_pinned(reader->cache, slot, data + (offset - state->run_at[s]));
    }
}

static void fill_release(fill_state *state, int s, int landed)
{
    if (!landed && state->run_from[s] < state->failed_from)
        state->failed_from = state->run_from[s];
    state->pending -= state->run_missing[s];
    state->busy[s] = 0;
    state->free_slots[state->free_count++] = s;
}

/* The position before which every row is handled: the first row of the earliest run still in
 * flight (completions come out of order) or failed, else `next`, the first row not queued. */
static Py_ssize_t fill_progress(const fill_state *state, Py_ssize_t next)
{
    Py_ssize_t done = next < state->failed_from ? next : state->failed_from;
    for (int s = 0; s < state->depth; s++)
        if (state->busy[s] && state->run_from[s] < done)
            done = state->run_from[s];
    return done;
}

/* Queue the runs from *next into free buffer slots (cache locked): runs the cache holds whole are
 * passed over; returns the FILL_ reason to stop queueing, or -1 to go on. The worker's reads are
 * queued one at a time: it reads them in turn, and a demand read must not wait for a queue of them. */
static int fill_queue(const disk_reader *reader, const fill_request *request, fill_state *state, Py_ssize_t *next,
                      fill_result *result)
{
    host_cache *cache = reader->cache;
    while (*next < request->count && state->free_count > 0 && (reader->context || state->batch == 0)) {
        if (request->stopped(request->owner))
            return FILL_STOPPED;
        Py_ssize_t from = *next, end = from + 1;
        off_t at = fill_block_at(reader, request, request->slots[from]);
        while (end < request->count && fill_block_at(reader, request, request->slots[end]) == at)
            end++;
        Py_ssize_t missing = 0, pages = 1;
        for (Py_ssize_t k = from; k < end; k++) {
            missing += !host_cache_holds(cache, request->slots[k]);
            pages += k > from && request->slots[k] / request->rows_per_page != request->slots[k - 1] / request->rows_per_page;
        }
        if (!missing) {
            result->rows_found += end - from;
            *next = end;
            continue;
        }
        int64_t pinned = host_cache_pinned(cache) + state->pending;
        if (pinned > 0 && pinned + missing > request->pin_limit)
            return FILL_PINS;
        int s = state->free_slots[--state->free_count];
        state->run_from[s] = from;
        state->run_to[s] = end;
        state->run_missing[s] = missing;
        state->run_at[s] = at;
        state->busy[s] = 1;
        state->pending += missing;
        state->queued[state->batch++] = s;
        result->rows_found += end - from - missing;
        result->rows_read += missing;
        result->pages_read += pages;
        *next = end;
    }
    return -1;
}

/* The batch queued, read one block at a time by the worker (no AIO context here). */
static int fill_by_worker(disk_reader *reader, const fill_request *request, fill_state *state, off_t *failed_at)
{
    int error = 0;
    for (int b = 0; b < state->batch; b++) {
        int s = state->queued[b];
        long got = 0;
        if (!error) {
            off_t bad_at = state->run_at[s];
            error = disk_reader_worker_read(reader, state->run_at[s], &got);
            error = error ? error : disk_reader_checked(reader, got, state->run_at[s]);
            error = error ? error : disk_reader_sums_match(reader, disk_reader_worker_block(reader), state->run_at[s],
                                                           &bad_at);
            reader->blocks_read++;
            if (error) {
                *failed_at = bad_at;
            } else {
                host_cache_lock(reader->cache);
                fill_admit(reader, request, state, s, disk_reader_worker_block(reader));
                host_cache_unlock(reader->cache);
            }
        }
        fill_release(state, s, !error);
    }
    state->batch = 0;
    return error;
}

int disk_reader_fill(disk_reader *reader, const fill_request *request, Py_ssize_t start, fill_result *result,
                     off_t *failed_at)
{
    *result = (fill_result){.done = start, .reason = FILL_DONE};
    fill_state *state = malloc(sizeof(fill_state));
    if (!state)
        return ENOMEM;
    int depth = reader->depth < MAX_DEPTH ? reader->depth : MAX_DEPTH;
    state->depth = state->free_count = depth;
    for (int s = 0; s < depth; s++) {
        state->free_slots[s] = depth - 1 - s;
        state->busy[s] = 0;
    }
    state->batch = state->in_flight = 0;
    state->pending = 0;
    state->failed_from = request->count;
    Py_ssize_t next = start;
    int queueing = 1, error = 0;
    while ((queueing && next < request->count) || state->in_flight > 0) {
        if (queueing && !reader->buffer) { /* abandon_reads found no memory for a new buffer */
            error = ENOMEM;
            queueing = 0;
            continue;
        }
        if (queueing && state->free_count > 0) {
            host_cache_lock(reader->cache);
            int reason = fill_queue(reader, request, state, &next, result);
            host_cache_unlock(reader->cache);
            if (reason >= 0) {
                result->reason = reason;
                queueing = 0;
            }
        }
        if (!reader->context) {
            error = fill_by_worker(reader, request, state, failed_at);
            queueing = queueing && !error;
            request->moved(request->owner, fill_progress(state, next));
            continue;
        }
        for (int b = 0; b < state->batch; b++) {
            int s = state->queued[b];
            state->iocbs[b] = (struct iocb){.aio_data = (uint64_t)s, .aio_lio_opcode = IOCB_CMD_PREAD,
                                            .aio_fildes = (uint32_t)reader->fd,
                                            .aio_buf = (uint64_t)(uintptr_t)(reader->buffer + (size_t)s * (size_t)reader->block),
                                            .aio_nbytes = (uint64_t)reader->block, .aio_offset = state->run_at[s]};
            state->pointers[b] = &state->iocbs[b];
        }
        int sent = 0;
        while (sent < state->batch) {
            long taken = syscall(SYS_io_submit, (aio_context_t)reader->context, (long)(state->batch - sent),
                                 state->pointers + sent);
            if (taken <= 0) {
                if (taken < 0 && errno == EINTR)
                    continue;
                error = taken < 0 ? errno : EIO;
                *failed_at = (off_t)state->iocbs[sent].aio_offset;
                for (int b = sent; b < state->batch; b++)
                    fill_release(state, (int)state->iocbs[b].aio_data, 0);
                queueing = 0;
                break;
            }
            sent += (int)taken;
            state->in_flight += (int)taken;
        }
        state->batch = 0;
        if (state->in_flight == 0) {
            request->moved(request->owner, fill_progress(state, next));
            continue;
        }
        struct timespec timeout = reader->timeout;
        long got = syscall(SYS_io_getevents, (aio_context_t)reader->context, 1L, (long)state->in_flight,
                           state->events, &timeout);
        if (got <= 0) {
            if (got < 0 && errno == EINTR)
                continue;
            /* The reads in flight still target the buffer: it is theirs, the fill fails. */
            if (!error) { /* name one of the reads waited for */
                int code = got < 0 ? errno : STALLED;
                *failed_at = 0;
                for (int s = 0; s < depth; s++)
                    if (state->busy[s]) {
                        *failed_at = state->run_at[s];
                        break;
                    }
                error = code;
            }
            disk_reader_abandon(reader);
            result->done = fill_progress(state, next);
            free(state);
            return error;
        }
        for (long e = 0; e < got; e++) { /* checked before the cache's lock: summing takes a while */
            int s = (int)state->events[e].data;
            state->bad_at[e] = state->run_at[s];
            state->outcome[e] = disk_reader_checked(reader, (long)state->events[e].res, state->run_at[s]);
            if (!state->outcome[e])
                state->outcome[e] = disk_reader_sums_match(reader, reader->buffer + (size_t)s * (size_t)reader->block,
                                                           state->run_at[s], &state->bad_at[e]);
        }
        host_cache_lock(reader->cache);
        for (long e = 0; e < got; e++) {
            int s = (int)state->events[e].data;
            int failed = state->outcome[e];
            if (failed && !error) {
                error = failed;
                *failed_at = state->bad_at[e];
                queueing = 0;
            }
            if (!failed)
                fill_admit(reader, request, state, s, reader->buffer + (size_t)s * (size_t)reader->block);
            fill_release(state, s, !failed);
        }
        host_cache_unlock(reader->cache);
        state->in_flight -= (int)got;
        reader->blocks_read += (uint64_t)got;
        request->moved(request->owner, fill_progress(state, next));
    }
    result->done = fill_progress(state, next);
    free(state);
    return error;
}
