/* Read-ahead into the host cache (ple_prep/runtime/readahead.py's compiled path): a reader of its
 * own (disk_reads.c: its AIO context, buffer and descriptor, a duplicate of the table's O_DIRECT
 * one) that reads a request's coming rows `depth` in flight from the first read to the last and
 * admits each block's rows pinned as it lands, without the GIL, so that no Python work between
 * batches leaves the disk idle.
 *
 * readahead_new(fd, data_offset, file_end, page_size, rows_per_page, row_bytes, num_slots, depth,
 *               timeout, synchronous, cache, sums) -> reader
 *     The reader owns `fd` from then on (closed when the reader is collected); `cache` is the
 *     table's host cache (hostcache_new), held. `sums`: None, or the table's page sums (uint32 a
 *     page, held), each block read checked against them (a differing page fails the fill, BAD_SUM,
 *     its block's rows not admitted). With `synchronous` (the table's reader found O_DIRECT
 *     reads complete inside io_submit here) it reads with its worker, one pread at a time: no probe
 *     of its own, whose io_submit a hung disk would hang out of the timeout's reach. OSError where
 *     its AIO context or buffer is refused.
 * readahead_fill(reader, serial, slots, start, pin_limit, stops)
 *         -> (done, rows_read, rows_found, pages_read, reason, error, failed_at)
 *     disk_reader_fill over slots[start:] (int64, each block's rows adjacent) for request `serial`;
 *     `reason` a FILL_ value (0 done, 1 stopped: a demand read waits, or readahead_stop was called
 *     since the count `stops` was read, 2 the pin limit), `error` 0, an errno, -1 (a short read),
 *     -2 (the disk stalled) or -3 (a page's sum differs), at file offset `failed_at` (for -3 the
 *     page's). One fill at a time.
 * readahead_hold(reader, delta): demand reads waiting, counted; a fill stops queueing while any is.
 * readahead_stop(reader): the fill in progress, or the next one given an older count, stops.
 * readahead_serve(reader, serial, done): the request read for now (0: none, its read-ahead ended
 *     or waits for pins) and its position; waiters of another request stop waiting.
 * readahead_progress(reader) -> (serial, done, stops): the request served and its position, and
 *     readahead_stop's count (read before deciding to fill: a stop made after it stops the fill).
 * readahead_wait(reader, serial, position) -> bool
 *     Waits (without the GIL) until request `serial`'s reads have handled every row up to and
 *     including `position`: True; False as soon as it is no longer served (readahead_serve), or
 *     after twice the read timeout. Between its fills (a demand read went first) it waits on.
 */
#define _GNU_SOURCE
#include "readahead.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "../../core/native/buffers.h"
#include "disk_fill.h"
#include "hostcache.h"

#define READ_AHEAD_CAPSULE "ple_prep.read_ahead"

typedef struct {
    disk_reader reader;
    int fd;
    PyObject *cache_capsule; /* held: the cache outlives the reader */
    Py_buffer sums;          /* held while the reader lives, or len 0 */
    Py_ssize_t page_size, rows_per_page, row_bytes, num_slots;
    double timeout;
    pthread_mutex_t lock;
    pthread_cond_t moved;
    long long serial;        /* under lock: the request served (readahead_serve), */
    Py_ssize_t done;         /* its position, */
    int filling;             /* and whether a call is inside readahead_fill */
    int hold, stops;         /* atomic: demand reads waiting; stop requests made */
} read_ahead;

typedef struct {
    read_ahead *reader;
    int stops; /* readahead_stop's count when the fill began */
} fill_owner;

static int fill_stopped(void *owner)
{
    fill_owner *fill = owner;
    return __atomic_load_n(&fill->reader->hold, __ATOMIC_ACQUIRE) != 0
           || __atomic_load_n(&fill->reader->stops, __ATOMIC_ACQUIRE) != fill->stops;
}

static void fill_moved(void *owner, Py_ssize_t done)
{
    read_ahead *reader = ((fill_owner *)owner)->reader;
    pthread_mutex_lock(&reader->lock);
    reader->done = done;
    pthread_cond_broadcast(&reader->moved);
    pthread_mutex_unlock(&reader->lock);
}

static read_ahead *reader_of(PyObject *capsule)
{
    return PyCapsule_GetPointer(capsule, READ_AHEAD_CAPSULE);
}

static void reader_destroy(PyObject *capsule)
{
    read_ahead *reader = reader_of(capsule);
    if (!reader)
        return;
    disk_reader_close(&reader->reader);
    close(reader->fd);
    Py_XDECREF(reader->cache_capsule);
    if (reader->sums.obj)
        PyBuffer_Release(&reader->sums);
    pthread_cond_destroy(&reader->moved);
    pthread_mutex_destroy(&reader->lock);
    PyMem_RawFree(reader);
}

PyObject *readahead_new(PyObject *self, PyObject *args)
{
    int fd, depth, synchronous;
    long long data_offset, file_end;
    Py_ssize_t page_size, rows_per_page, row_bytes, num_slots;
    double timeout;
    PyObject *cache_capsule, *sums_object;
    if (!PyArg_ParseTuple(args, "iLLnnnnidpOO", &fd, &data_offset, &file_end, &page_size, &rows_per_page, &row_bytes,
                          &num_slots, &depth, &timeout, &synchronous, &cache_capsule, &sums_object))
        return NULL;
    host_cache *cache = host_cache_of(cache_capsule);
    if (!cache)
        return NULL;
    if (page_size < 1 || rows_per_page < 1 || row_bytes < 1 || rows_per_page * row_bytes > page_size || num_slots < 0
        || row_bytes != host_cache_row_bytes(cache)) {
        PyErr_SetString(PyExc_ValueError, "readahead_new: the table's geometry or its cache's rows disagree");
        return NULL;
    }
    Py_buffer sums = {0};
    if (sums_object != Py_None && get_buffer(sums_object, &sums, 0, sizeof(uint32_t), "sums") != 0)
        return NULL;
    read_ahead *reader = PyMem_RawCalloc(1, sizeof(read_ahead));
    if (!reader) {
        if (sums.obj)
            PyBuffer_Release(&sums);
        return PyErr_NoMemory();
    }
    if (disk_reader_open(&reader->reader, fd, (off_t)data_offset, (off_t)file_end, page_size, 0, depth, timeout) != 0) {
        PyMem_RawFree(reader);
        if (sums.obj)
            PyBuffer_Release(&sums);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (synchronous)
        disk_reader_use_worker(&reader->reader);
    reader->sums = sums;
    if (sums.len > 0)
        disk_reader_check_sums(&reader->reader, sums.buf, sums.len / (Py_ssize_t)sizeof(uint32_t));
    reader->reader.cache = cache;
    reader->fd = fd;
    reader->page_size = page_size;
    reader->rows_per_page = rows_per_page;
    reader->row_bytes = row_bytes;
    reader->num_slots = num_slots;
    reader->timeout = timeout;
    pthread_condattr_t clock;
    pthread_condattr_init(&clock);
    pthread_condattr_setclock(&clock, CLOCK_MONOTONIC);
    pthread_mutex_init(&reader->lock, NULL);
    pthread_cond_init(&reader->moved, &clock);
    pthread_condattr_destroy(&clock);
    PyObject *capsule = PyCapsule_New(reader, READ_AHEAD_CAPSULE, reader_destroy);
    if (!capsule) { /* the caller still owns fd */
        disk_reader_close(&reader->reader);
        if (reader->sums.obj)
            PyBuffer_Release(&reader->sums);
        pthread_cond_destroy(&reader->moved);
        pthread_mutex_destroy(&reader->lock);
        PyMem_RawFree(reader);
        return NULL;
    }
    Py_INCREF(cache_capsule);
    reader->cache_capsule = cache_capsule;
    return capsule;
}

PyObject *readahead_fill(PyObject *self, PyObject *args)
{
    PyObject *capsule, *slots_object;
    long long serial;
    Py_ssize_t start;
    long long pin_limit;
    int stops;
    if (!PyArg_ParseTuple(args, "OLOnLi", &capsule, &serial, &slots_object, &start, &pin_limit, &stops))
        return NULL;
    read_ahead *reader = reader_of(capsule);
    if (!reader)
        return NULL;
    Py_buffer slots;
    if (get_buffer(slots_object, &slots, 0, sizeof(int64_t), "slots") != 0)
        return NULL;
    Py_ssize_t count = slots.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *slot = slots.buf;
    const char *refused = start < 0 || start > count ? "readahead_fill: start lies outside slots" : NULL;
    for (Py_ssize_t k = start; k < count && !refused; k++)
        if (slot[k] < 0 || slot[k] >= reader->num_slots)
            refused = "readahead_fill: a slot lies outside the table";
    pthread_mutex_lock(&reader->lock);
    if (!refused && reader->filling)
        refused = "readahead_fill: a fill is in progress on this reader";
    if (!refused) {
        reader->filling = 1;
        reader->serial = serial;
        reader->done = start;
    }
    pthread_mutex_unlock(&reader->lock);
    if (refused) {
        PyBuffer_Release(&slots);
        PyErr_SetString(PyExc_ValueError, refused);
        return NULL;
    }
    fill_owner owner = {.reader = reader, .stops = stops};
    fill_request request = {.slots = slot, .count = count, .page_size = reader->page_size,
                            .rows_per_page = reader->rows_per_page, .row_bytes = reader->row_bytes,
                            .pin_limit = pin_limit, .stopped = fill_stopped, .moved = fill_moved, .owner = &owner};
    fill_result result;
    off_t failed_at = 0;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = disk_reader_fill(&reader->reader, &request, start, &result, &failed_at);
    pthread_mutex_lock(&reader->lock);
    reader->done = result.done;
    reader->filling = 0;
    pthread_cond_broadcast(&reader->moved);
    pthread_mutex_unlock(&reader->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&slots);
    return Py_BuildValue("nnnniiL", result.done, result.rows_read, result.rows_found, result.pages_read, result.reason,
                         error, (long long)failed_at);
}

PyObject *readahead_hold(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    int delta;
    if (!PyArg_ParseTuple(args, "Oi", &capsule, &delta))
        return NULL;
    read_ahead *reader = reader_of(capsule);
    if (!reader)
        return NULL;
    __atomic_add_fetch(&reader->hold, delta, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

PyObject *readahead_stop(PyObject *self, PyObject *capsule)
{
    read_ahead *reader = reader_of(capsule);
    if (!reader)
        return NULL;
    __atomic_add_fetch(&reader->stops, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

PyObject *readahead_serve(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    long long serial;
    Py_ssize_t done;
    if (!PyArg_ParseTuple(args, "OLn", &capsule, &serial, &done))
        return NULL;
    read_ahead *reader = reader_of(capsule);
    if (!reader)
        return NULL;
    pthread_mutex_lock(&reader->lock);
    reader->serial = serial;
    reader->done = done;
    pthread_cond_broadcast(&reader->moved);
    pthread_mutex_unlock(&reader->lock);
    Py_RETURN_NONE;
}

PyObject *readahead_progress(PyObject *self, PyObject *capsule)
{
    read_ahead *reader = reader_of(capsule);
    if (!reader)
        return NULL;
    pthread_mutex_lock(&reader->lock);
    long long serial = reader->serial;
    Py_ssize_t done = reader->done;
    pthread_mutex_unlock(&reader->lock);
    return Py_BuildValue("Lni", serial, done, __atomic_load_n(&reader->stops, __ATOMIC_ACQUIRE));
}

PyObject *readahead_wait(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    long long serial;
    Py_ssize_t position;
    if (!PyArg_ParseTuple(args, "OLn", &capsule, &serial, &position))
        return NULL;
    read_ahead *reader = reader_of(capsule);
    if (!reader)
        return NULL;
    int passed;
    Py_BEGIN_ALLOW_THREADS
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    double limit = 2 * reader->timeout;
    deadline.tv_sec += (time_t)limit;
    deadline.tv_nsec += (long)((limit - (double)(time_t)limit) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&reader->lock);
    while (reader->serial == serial && reader->done <= position)
        if (pthread_cond_timedwait(&reader->moved, &reader->lock, &deadline) == ETIMEDOUT)
            break;
    passed = reader->serial == serial && reader->done > position;
    pthread_mutex_unlock(&reader->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(passed);
}
