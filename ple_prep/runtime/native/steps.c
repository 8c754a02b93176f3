/* The step service: one thread per lookup that serves steps a device starts and waits for itself,
 * so that everything the device does for a step can be captured in one CUDA graph and replayed
 * (runtime/device/steps.py holds the device side and the protocol's description).
 *
 * Three int32 words in pinned memory, a cache line apart, carry a step:
 *   flags[REQUEST]  the device writes the step's id count after copying its ids into the pinned
 *                   ids buffer (a stream memory operation); the thread takes it and writes 0;
 *   flags[ARRIVED]  the device writes 1 when it reaches the step's finish (before its wait for
 *                   the fetch) and 0 once its wait is over: the thread, finding it set when the
 *                   rows are ready, counts the step as late;
 *   flags[READY]    the thread stores 1 once the step's rows and index are staged in pinned
 *                   memory; the device waits for 1, writes 0 and copies them (on the CPU the
 *                   caller stores the arrival, waits and resets both).
 *   flags[FAILED]   the thread stores 1 when it keeps a failure, step_service_error's take stores
 *                   0: the caller's start reads it before it asks for the failure.
 * The device writes the request of step n + 1 after its reset of READY for step n, so a step's
 * flags never mix with the next one's.
 *
 * Per step: `stage` (stage.c) with the step's count; where the disk rows are not in the page
 * cache, disk_reads.c stages them: from the table's host cache (hostcache.c, under its own lock)
 * where it holds them, the others read from the file (O_DIRECT) and admitted into that cache, which
 * read-ahead (runtime/readahead.py) fills too. The thread never takes the GIL: a Python thread that
 * holds it while it waits for the device would wait for a step that waits for it. A failed step
 * (an id outside the table, a read that failed or stalled) has its index name the poison row (a
 * tier row whose every value decodes to NaN) at every position, so the device gets no stale or
 * wrong rows;
 * the first error is kept for step_service_error, which the Python side raises. Then READY. The
 * thread makes no CUDA call: only its host stores release the device's waits, so no device work
 * queued by any thread can hold them (runtime/device/steps.py). The thread polls REQUEST spinning
 * for SPIN_NS after a step, then sleeping SLEEP_NS apart, and IDLE_SLEEP_NS apart once idle for
 * IDLE_NS. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/prctl.h>

#include "../../core/native/rows.h"
#include "disk_reads.h"
#include "failure_record.h"
#include "hostcache.h"
#include "pool.h"
#include "stage.h"
#include "steps.h"

#define REQUEST 0
#define ARRIVED 16
#define READY 32
#define FAILED 48
#define FLAG_WORDS 64
#define SPIN_NS 200000
#define SLEEP_NS 20000
#define IDLE_NS 100000000
#define IDLE_SLEEP_NS 1000000
#define SERVICE_CAPSULE "ple_prep.step_service"

typedef struct {
    uint64_t steps, ids, disk_positions, cached_positions, host_cache_positions, read_ahead_positions, cold_steps,
        failed_steps, late_steps, host_ns, late_host_ns, copied_bytes, blocks_read, bytes_read;
} step_stats;

/* What failed a step (the first failure since step_service_error took the last). */
enum { FAILED_NONE, FAILED_ID, FAILED_READ, FAILED_COUNT, FAILED_NO_READER, FAILED_MAPPED };

typedef struct {
    stage_call *call;
    Py_ssize_t capacity, part_ids;
    int threads;
    int32_t poison_row;
    Py_buffer flags_view;
    int32_t *flags;
    Py_buffer record_view;      /* a failure record other processes read (runtime/failure_record.py), or len 0 */
    Py_buffer sums_view;        /* the table's page sums its reads are checked against (disk_reads.c), or len 0 */
    disk_reader reader;
    int has_reader;
    int async_reads;            /* the reader's reads go through native AIO (not one pread at a time) */
    PyObject *cache;            /* the host cache's capsule (held), or NULL */
    int failure;                /* FAILED_*, under stats_lock */
    long long failure_value;    /* the id, errno (SHORT_READ) or count */
    long long failure_offset;   /* the file offset of a failed read */
    int device_copies;          /* a device copies each step's span (counted in copied_bytes) */
    _Atomic int stopping;
    int running;
    pthread_t thread;
    pthread_mutex_t stats_lock;
    step_stats stats;
} service;

static int32_t load_flag(const service *server, int word)
{
    return __atomic_load_n(&server->flags[word], __ATOMIC_ACQUIRE);
}

static void store_flag(service *server, int word, int32_t value)
{
    __atomic_store_n(&server->flags[word], value, __ATOMIC_RELEASE);
}

static void release_views(service *server)
{
    PyBuffer_Release(&server->flags_view);
    PyBuffer_Release(&server->record_view);
    PyBuffer_Release(&server->sums_view);
}

/* The next request's count, or 0 once stopping. */
static int32_t next_request(service *server)
{
    uint64_t idle_since = monotonic_ns();
    unsigned spins = 0;
    for (;;) {
        int32_t count = load_flag(server, REQUEST);
        if (count != 0)
            return count;
        if (atomic_load_explicit(&server->stopping, memory_order_relaxed))
            return 0;
        if (++spins % 64 != 0) {
            cpu_relax();
            continue;
        }
        uint64_t idle = monotonic_ns() - idle_since;
        if (idle < SPIN_NS)
            continue;
        struct timespec pause = {0, idle < IDLE_NS ? SLEEP_NS : IDLE_SLEEP_NS};
        nanosleep(&pause, NULL);
    }
}

/* Into the shared record, if it is still empty: kind, value, offset, then the state (released), so
 * a process reading the state reads the rest whole. Before the step's READY: a step that used the
 * failed rows is complete only after the record shows them. */
static void share_failure(service *server, int kind, long long value, long long offset)
{
    if (server->record_view.len == 0)
        return;
    char *record = server->record_view.buf;
    if (!record_claim_state((int32_t *)record))
        return;
    int32_t kind_word = kind;
    int64_t words[2] = {value, offset};
    memcpy(record + 4, &kind_word, sizeof kind_word);
    memcpy(record + 8, words, sizeof words);
    record_store_state((int32_t *)record, RECORD_STEP_FAILURE);
}

/* Keep the step's failure if it is the first since the last was taken; share the first ever. */
static void record_failure(service *server, int kind, long long value, long long offset)
{
    pthread_mutex_lock(&server->stats_lock);
    if (server->failure == FAILED_NONE) {
        server->failure = kind;
        server->failure_value = value;
        server->failure_offset = offset;
        store_flag(server, FAILED, 1);
    }
    share_failure(server, kind, value, offset);
    pthread_mutex_unlock(&server->stats_lock);
}

/* One step of `count` ids: staged (or failed: the poison row everywhere), then READY. */
static void serve(service *server, Py_ssize_t count)
{
    uint64_t began = monotonic_ns();
    stage_call *call = server->call;
    stage_request *request = &call->request;
    Py_ssize_t first, disk = 0, cache_hits = 0, read_ahead_hits = 0;
    int cached = 0;
    if (count <= server->capacity) {
        Py_ssize_t parts = server->threads;
        if (parts > count / server->part_ids)
            parts = count / server->part_ids > 0 ? count / server->part_ids : 1;
        request->count = count;
        request->parts = (int)parts;
        run_stage(call);
        disk = call->bad < 0 ? call->disk : 0;
        cached = call->bad < 0 && call->staged;
        first = call->out_rows - disk;
        off_t failed_at = 0;
        int error;
        int part = 0;
        while (cached && part < request->parts && !request->faulted[part])
            part++;
        if (call->bad >= 0) {
            record_failure(server, FAILED_ID, (long long)request->id[call->bad], 0);
            first = -1;
        } else if (cached && part < request->parts) {
            /* A page of the mapping the kernel could not read (the stage copies without a signal). */
            record_failure(server, FAILED_MAPPED, EIO, (long long)(request->fault[part] - request->mapping));
            first = -1;
        } else if (!cached && !server->has_reader) {
            record_failure(server, FAILED_NO_READER, 0, 0);
            first = -1;
        } else if (!cached && (error = disk_reader_stage(&server->reader, call, disk, &failed_at)) != 0) {
            record_failure(server, FAILED_READ, error, (long long)failed_at);
            first = -1;
        } else if (!cached) {
            cache_hits = server->reader.cache_hits;
            read_ahead_hits = server->reader.read_ahead_hits;
        }
    } else {
        record_failure(server, FAILED_COUNT, count, 0);
        first = -1;
        count = server->capacity;
    }
    int failed = first < 0 || first > call->out_rows;
    if (failed) {
        first = call->out_rows;
        for (Py_ssize_t i = 0; i < count; i++)
            request->index[i] = server->poison_row;
    }
    int late = load_flag(server, ARRIVED) != 0;
    /* The device copies the span `count` positions can use: their last `count` staging rows
     * (disk rows fill the staging rows from their end) through their index. */
    size_t low = (size_t)(call->out_rows - count) * (size_t)request->row_bytes;
    size_t high = (size_t)((const char *)(request->index + count) - request->out);
    uint64_t took = monotonic_ns() - began;
    pthread_mutex_lock(&server->stats_lock);
    step_stats *stats = &server->stats;
    stats->steps++;
    stats->ids += (uint64_t)count;
    stats->disk_positions += (uint64_t)disk;
    stats->cached_positions += cached ? (uint64_t)disk : 0;
    stats->host_cache_positions += (uint64_t)cache_hits;
    stats->read_ahead_positions += (uint64_t)read_ahead_hits;
    stats->cold_steps += !cached && !failed;
    stats->failed_steps += failed;
    stats->late_steps += late;
    stats->host_ns += took;
    stats->late_host_ns += late ? took : 0;
    stats->copied_bytes += server->device_copies ? high - low : 0;
    stats->blocks_read = server->reader.blocks_read;
    stats->bytes_read = server->reader.blocks_read * (uint64_t)server->reader.block;
    pthread_mutex_unlock(&server->stats_lock);
    store_flag(server, READY, 1); /* release: the staged span is visible before it */
}

static void *service_main(void *argument)
{
    service *server = argument;
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* its polls sleep SLEEP_NS, not the default 50 us more */
    for (;;) {
        int32_t count = next_request(server);
        if (count == 0)
            break;
        store_flag(server, REQUEST, 0);
        serve(server, count);
    }
    return NULL;
}

static void stop(service *server)
{
    if (!server->running)
        return;
    atomic_store_explicit(&server->stopping, 1, memory_order_relaxed);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(server->thread, NULL);
    Py_END_ALLOW_THREADS
    server->running = 0;
}

static void service_destroy(PyObject *capsule)
{
    service *server = PyCapsule_GetPointer(capsule, SERVICE_CAPSULE);
    if (!server)
        return;
    stop(server);
    free_stage_call(server->call);
    release_views(server);
    if (server->has_reader)
        disk_reader_close(&server->reader);
    Py_XDECREF(server->cache);
    pthread_mutex_destroy(&server->stats_lock);
    PyMem_RawFree(server);
}

/* step_service(flags, disk, poison_row, (threads, part_ids), device_copies, record, *the arguments of stage)
 *     -> service
 * A step's stage is split over up to `threads` threads, parts of at least part_ids ids. `disk`:
 * None (rows not in the page cache fail their step) or (fd, data_offset, file_end, page_size,
 * depth, timeout, cache, synchronous, sums) for disk_reads.c (a read wait of `timeout` seconds with
 * no progress fails the step; `cache`: a host cache of hostcache_new for the table's rows, or None;
 * `synchronous`: O_DIRECT reads complete inside io_submit on this file system, so the worker's
 * preads serve them; `sums`: uint32, the table's page sums each read is checked against, or None),
 * the descriptor held open by the caller until the service is stopped.
 * `device_copies`: a device copies each step's span from the pinned buffer (counted in copied_bytes).
 * `record`: None, or a writable buffer of at least RECORD_BYTES (shared with other processes) that
 * gets the first failure ever (share_failure). */
PyObject *step_service(PyObject *self, PyObject *args)
{
    if (PyTuple_GET_SIZE(args) < 6) {
        PyErr_SetString(PyExc_TypeError, "step_service(flags, disk, poison_row, (threads, part_ids), device_copies, "
                                         "record, *stage arguments)");
        return NULL;
    }
    PyObject *disk = PyTuple_GET_ITEM(args, 1);
    int device_copies = PyObject_IsTrue(PyTuple_GET_ITEM(args, 4));
    long poison_row = PyLong_AsLong(PyTuple_GET_ITEM(args, 2));
    Py_ssize_t threads, part_ids;
    if (device_copies < 0 || PyErr_Occurred() || !PyArg_ParseTuple(PyTuple_GET_ITEM(args, 3), "nn;threads must be (threads, part_ids)",
                                              &threads, &part_ids))
        return NULL;
    int fd = -1, depth = 0, synchronous = 0;
    long long data_offset = 0, file_end = 0;
    Py_ssize_t page_size = 0;
    double timeout = 0;
    PyObject *cache = Py_None, *sums = Py_None;
    if (disk != Py_None
        && !PyArg_ParseTuple(disk, "iLLnidOpO;disk must be (fd, data_offset, file_end, page_size, depth, timeout, cache, "
                             "synchronous, sums)", &fd, &data_offset, &file_end, &page_size, &depth, &timeout, &cache,
                             &synchronous, &sums))
        return NULL;
    host_cache *rows_cache = cache == Py_None ? NULL : host_cache_of(cache);
    if (cache != Py_None && !rows_cache)
        return NULL;
    service *server = PyMem_RawCalloc(1, sizeof(service));
    if (!server)
        return PyErr_NoMemory();
    PyObject *record = PyTuple_GET_ITEM(args, 5);
    if (get_buffer(PyTuple_GET_ITEM(args, 0), &server->flags_view, 1, sizeof(int32_t), "flags") != 0
        || (record != Py_None && get_buffer(record, &server->record_view, 1, 1, "record") != 0)
        || (sums != Py_None && get_buffer(sums, &server->sums_view, 0, sizeof(uint32_t), "sums") != 0)) {
        release_views(server);
        PyMem_RawFree(server);
        return NULL;
    }
    PyObject *stage_args = PyTuple_GetSlice(args, 6, PyTuple_GET_SIZE(args));
    stage_call *call = stage_args ? new_stage_call(stage_args) : NULL;
    Py_XDECREF(stage_args);
    const char *refused = !call ? NULL
        : server->flags_view.len < FLAG_WORDS * (Py_ssize_t)sizeof(int32_t) ? "step_service: flags must be 64 int32"
        : record != Py_None && !record_buffer_fits(&server->record_view)
            ? "step_service: a record must be 512 bytes, 8-byte aligned"
        : (const char *)call->request.index < call->request.out + call->out_rows * call->request.row_bytes
            ? "step_service: index must follow out in one buffer"
        : poison_row < 0 || poison_row >= call->request.num_resident + call->out_rows
            ? "step_service: the poison row is not a tier row"
        : rows_cache && host_cache_row_bytes(rows_cache) != call->request.row_bytes
            ? "step_service: the host cache holds rows of another size" : NULL;
    if (!call || refused) {
        if (refused)
            PyErr_SetString(PyExc_ValueError, refused);
        if (call) {
            free_stage_call(call);
        }
        release_views(server);
        PyMem_RawFree(server);
        return NULL;
    }
    server->call = call;
    server->capacity = call->request.count;
    server->threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : (int)threads;
    server->part_ids = part_ids > PREFETCH_AHEAD ? part_ids : PREFETCH_AHEAD;
    server->poison_row = (int32_t)poison_row;
    server->flags = server->flags_view.buf;
    if (fd >= 0) {
        if (disk_reader_open(&server->reader, fd, (off_t)data_offset, (off_t)file_end, page_size, server->capacity,
                             depth, timeout) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            free_stage_call(call);
            release_views(server);
            PyMem_RawFree(server);
            return NULL;
        }
        if (synchronous)
            disk_reader_use_worker(&server->reader);
        server->has_reader = 1;
        server->async_reads = server->reader.context != 0;
        server->reader.cache = rows_cache;
        if (server->sums_view.len > 0)
            disk_reader_check_sums(&server->reader, server->sums_view.buf,
                                   server->sums_view.len / (Py_ssize_t)sizeof(uint32_t));
        if (rows_cache) {
            Py_INCREF(cache);
            server->cache = cache;
        }
    }
    server->device_copies = device_copies;
    pthread_mutex_init(&server->stats_lock, NULL);
    PyObject *capsule = PyCapsule_New(server, SERVICE_CAPSULE, service_destroy);
    if (!capsule) {
        free_stage_call(call);
        release_views(server);
        if (server->has_reader)
            disk_reader_close(&server->reader);
        Py_XDECREF(server->cache);
        pthread_mutex_destroy(&server->stats_lock);
        PyMem_RawFree(server);
        return NULL;
    }
    if (pthread_create(&server->thread, NULL, service_main, server) != 0) {
        Py_DECREF(capsule);
        PyErr_SetString(PyExc_OSError, "step_service: cannot start a thread");
        return NULL;
    }
    server->running = 1;
    return capsule;
}

static service *service_of(PyObject *args)
{
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule))
        return NULL;
    return PyCapsule_GetPointer(capsule, SERVICE_CAPSULE);
}

/* step_service_stop(service): the thread stops once it is between steps, and is joined. */
PyObject *step_service_stop(PyObject *self, PyObject *args)
{
    service *server = service_of(args);
    if (!server)
        return NULL;
    stop(server);
    Py_RETURN_NONE;
}

/* step_service_stats(service) -> dict of the counters since the start. */
PyObject *step_service_stats(PyObject *self, PyObject *args)
{
    service *server = service_of(args);
    if (!server)
        return NULL;
    pthread_mutex_lock(&server->stats_lock);
    step_stats stats = server->stats;
    pthread_mutex_unlock(&server->stats_lock);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsi}", "steps", stats.steps, "ids", stats.ids,
                         "disk_positions", stats.disk_positions, "cached_positions", stats.cached_positions,
                         "host_cache_positions", stats.host_cache_positions, "read_ahead_positions",
                         stats.read_ahead_positions, "cold_steps", stats.cold_steps, "failed_steps",
                         stats.failed_steps, "late_steps", stats.late_steps, "host_ns", stats.host_ns,
                         "late_host_ns", stats.late_host_ns, "copied_bytes", stats.copied_bytes, "blocks_read",
                         stats.blocks_read, "bytes_read", stats.bytes_read, "async_reads", server->async_reads);
}

/* step_service_error(service, take) -> None or (kind, value, offset): the first failure since the
 * last taken (kinds: "id" the id, "read" errno, -1 for a short read, -2 for a stalled disk or -3 for
 * a page whose sum differs, and the offset, "count", "no_reader", "mapped" EIO and the offset of a
 * page the mapping could not read); with `take`, cleared. */
PyObject *step_service_error(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    int take;
    if (!PyArg_ParseTuple(args, "Op", &capsule, &take))
        return NULL;
    service *server = PyCapsule_GetPointer(capsule, SERVICE_CAPSULE);
    if (!server)
        return NULL;
    static const char *kinds[] = {"none", "id", "read", "count", "no_reader", "mapped"};
    pthread_mutex_lock(&server->stats_lock);
    int kind = server->failure;
    long long value = server->failure_value, offset = server->failure_offset;
    if (take && kind != FAILED_NONE) {
        server->failure = FAILED_NONE;
        store_flag(server, FAILED, 0);
    }
    pthread_mutex_unlock(&server->stats_lock);
    if (kind == FAILED_NONE)
        Py_RETURN_NONE;
    return Py_BuildValue("(sLL)", kinds[kind], value, offset);
}
