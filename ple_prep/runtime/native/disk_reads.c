/* The step service's cold reads (disk_reads.h): the distinct blocks of a step's disk rows read with
 * Linux native AIO on the table's O_DIRECT descriptor, `depth` in flight (at most MAX_DEPTH), each block's rows copied
 * to their staging rows as it lands; where the kernel refuses AIO, one pread at a time. As the
 * runtime's DirectReader (runtime/direct.py) reads a request, but on the service's thread and
 * without the GIL: a Python thread that holds it while it waits for the device (a synchronous copy
 * back, a full launch queue) would otherwise wait for a step that waits for it. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/aio_abi.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../../core/native/rows.h"
#include "disk_reads.h"

#define MIN_BLOCK 4096
/* Low bits of a key hold the position's rank among the step's disk positions. */
#define RANK_BITS 24
#define MAX_DEPTH 512

int disk_reader_open(disk_reader *reader, int fd, off_t data_offset, off_t file_end, Py_ssize_t page_size,
                     Py_ssize_t capacity, int depth)
{
    depth = depth < MAX_DEPTH ? depth : MAX_DEPTH;
    *reader = (disk_reader){.fd = fd, .data_offset = data_offset, .file_end = file_end, .depth = depth};
    reader->block = page_size > MIN_BLOCK ? page_size : MIN_BLOCK;
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

void disk_reader_close(disk_reader *reader)
{
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
static int checked(const disk_reader *reader, long result, off_t offset)
{
    if (result < 0)
        return (int)-result;
    if (result < reader->block && offset + result < reader->file_end)
        return SHORT_READ;
    return 0;
}

/* Copy the rows of keys [from, to) (one block, at `data`) to their staging rows. */
static void copy_block(const disk_reader *reader, stage_call *call, Py_ssize_t first, Py_ssize_t from,
                       Py_ssize_t to, const char *data, off_t block_offset)
{
    stage_request *request = &call->request;
    for (Py_ssize_t k = from; k < to; k++) {
        Py_ssize_t rank = (Py_ssize_t)(reader->keys[k] & ((1u << RANK_BITS) - 1));
        int64_t position = reader->positions[rank];
        off_t offset = row_offset(reader, request, request->slots[position]);
        memcpy(request->out + (first + rank) * request->row_bytes, data + (offset - block_offset),
               (size_t)request->row_bytes);
        request->index[position] = (int32_t)(request->num_resident + first + rank);
    }
}

int disk_reader_stage(disk_reader *reader, stage_call *call, Py_ssize_t disk, off_t *failed_at)
{
    stage_request *request = &call->request;
    Py_ssize_t first = call->out_rows - disk, found = 0;
    for (Py_ssize_t i = 0; i < request->count && found < disk; i++) {
        int64_t slot = request->slots[i];
        if (slot < request->num_resident)
            continue;
        reader->positions[found] = i;
        uint64_t block = (uint64_t)(row_offset(reader, request, slot) / reader->block);
        reader->keys[found] = (block << RANK_BITS) | (uint64_t)found;
        found++;
    }
    qsort(reader->keys, (size_t)found, sizeof(uint64_t), compare_keys);
    /* The keys of one block are a run; runs are read in order, `depth` blocks in flight, each in a
     * buffer slot that holds it until its rows are copied. */
    Py_ssize_t next = 0; /* first key of the next block to submit */
    int in_flight = 0, error = 0;
    struct iocb iocbs[MAX_DEPTH], *pointers[MAX_DEPTH];
    Py_ssize_t run_from[MAX_DEPTH], run_to[MAX_DEPTH];
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
            if (!reader->context) {
                ssize_t got = pread(reader->fd, data, (size_t)reader->block, offset);
                error = checked(reader, got < 0 ? -errno : got, offset);
                reader->blocks_read++;
                if (error)
                    *failed_at = offset;
                else
                    copy_block(reader, call, first, next, end, data, offset);
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
        long got = syscall(SYS_io_getevents, (aio_context_t)reader->context, 1L, (long)in_flight, events, NULL);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            /* The reads in flight still target the buffer: nothing more can be read safely. */
            error = errno;
            *failed_at = 0;
            return error;
        }
        for (long e = 0; e < got; e++) {
            int s = (int)events[e].data;
            off_t offset = (off_t)((reader->keys[run_from[s]] >> RANK_BITS) * (uint64_t)reader->block);
            int failed = checked(reader, (long)events[e].res, offset);
            if (failed && !error) {
                error = failed;
                *failed_at = offset;
            }
            if (!failed && !error)
                copy_block(reader, call, first, run_from[s], run_to[s],
                           reader->buffer + (size_t)s * (size_t)reader->block, offset);
            free_slots[free_count++] = s;
        }
        in_flight -= (int)got;
        reader->blocks_read += (uint64_t)got;
    }
    return error;
}
