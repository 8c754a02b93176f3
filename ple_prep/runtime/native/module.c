/* ple_prep.runtime._native: the runtime's host staging and CUDA driver calls, compiled when a
 * compiler is there at install (setup.py); ple_prep/runtime/gather.py holds the numpy fallback of
 * stage and cached, with the same results bit for bit (the CUDA driver calls have none: the device
 * package uses torch's copies without the helper). All release the GIL.
 *
 * TableView(mapping, rank_words, packed_slots, first_row, num_rows, data_offset, page_size,
 *           rows_per_page, row_bytes, num_slots)
 *     A table's mapping, geometry and rank index (format/order.py), checked once and held by the
 *     view, and by every call and job that uses it, for as long as they read them (view.c).
 * stage(view, ids, num_resident, slots, index, out, probes, threads) -> (disk, staged)
 *     The host half of a tiered lookup (runtime/gather.py's Gatherer.stage): slots[i] = the file
 *     slot of row id ids[i] (the identity where the index places no row), index[i] = that slot where
 *     it is below num_resident (the resident tier's rows); `disk` counts the other positions. If
 *     `probes` rows spread over those are in the page cache, the k-th of them (in position order)
 *     is copied to row len(out) - disk + k of `out` and index[i] = num_resident + that row, and
 *     `staged` is true. Split over `threads` threads (a pool kept by this module). `out` and
 *     `index` are written past the CPU caches (store_row_uncached): a device copies them next.
 * stage_when(flags, ids_value, free_value, copy, *the arguments of stage) -> job
 * stage_joined(job, cancel=False) -> ((disk, staged), copied)
 * stage_job_checks(job) -> int
 *     `stage` on a thread of its own, started once flags[0] == ids_value and flags[1] == free_value
 *     (written by a device into pinned memory; a value below 0 is not waited for), and its result
 *     (runtime/device/'s device ids). With a `copy` (not None) the thread then queues the staged
 *     rows' copy to the device itself, and `copied` says it did; with `cancel`, a job not yet
 *     started stages nothing and None is returned. stage_job_checks counts the thread's reads
 *     of the flags that found them not yet set.
 * device_context(ordinal) -> context
 * queue_ids_copy(context, stream, event, target, source, bytes, flag, flag_source)
 *     A device's CUDA primary context, and a start's ids copy to pinned memory as driver calls.
 * stage_and_launch(context, events, graph, stream, *the arguments of stage) -> ((disk, staged), launched)
 *     `stage` once CUDA events have completed, then, if the rows were staged, a CUDA graph's launch:
 *     a small device-ids request's finish in one call.
 * cached(view, slots, probes)
 *     Whether the memory page holding the first byte of each of `probes` rows spread over the
 *     request (first and last included) is in the page cache (mincore); slots outside the table are
 *     left to copy_rows to refuse; OSError if mincore fails.
 *
 * hostcache_new, hostcache_lookup, hostcache_probe, hostcache_admit, hostcache_reset, hostcache_counts:
 *     the host cache (hostcache.c), under a lock of its own that the step service shares.
 * readahead_new, readahead_fill, readahead_hold, readahead_stop, readahead_serve, readahead_progress,
 * readahead_wait:
 *     read-ahead into the host cache on a reader of its own (readahead.c).
 * record_claim, record_state:
 *     a failure record's state word, claimed, stored and loaded atomically (failure_record.c).
 *
 * Files: view.c (the table view), stage.c (the stage and its parts), pool.c (the thread pool),
 * jobs.c (stage_when), cuda.c (the driver table), hostcache.c (runtime/hostcache.py's loops),
 * readahead.c and disk_fill.c (read-ahead's reader and its reads), failure_record.c; the rows' addresses and the slot lookup come from core/native/.
 */
#include <pthread.h>

#include "../../core/native/buffers.h"
#include "../../core/native/guard.h"
#include "../../core/native/rows.h"
#include "cuda.h"
#include "failure_record.h"
#include "hostcache.h"
#include "jobs.h"
#include "pool.h"
#include "readahead.h"
#include "stage.h"
#include "view.h"
#include "steps.h"

static PyObject *stage(PyObject *self, PyObject *args)
{
    stage_call *call = new_stage_call(args);
    if (!call)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    run_stage(call);
    Py_END_ALLOW_THREADS
    return finish_stage(call);
}

/* The primary context of device `ordinal` (the one torch uses), retained, as an int. */
static PyObject *device_context(PyObject *self, PyObject *args)
{
    int ordinal, device;
    if (!PyArg_ParseTuple(args, "i", &ordinal) || cuda_ready() != 0)
        return NULL;
    void *context = NULL;
    cuda_result result = cuda.init(0);
    if (result == 0)
        result = cuda.device_get(&device, ordinal);
    if (result == 0)
        result = cuda.primary_context_retain(&context, device);
    if (result != 0)
        return refuse_cuda("opening the device's CUDA context", result);
    return PyLong_FromVoidPtr(context);
}

/* queue_ids_copy(context, stream, event, target, source, bytes, flag, flag_source): on `stream`,
 * the copy of `bytes` from device address `source` into pinned `target`, then (flag_source not 0)
 * of the 4 bytes at device address `flag_source` into pinned `flag`, then a record of `event`.
 * A start's ids copy in three driver calls, each a fraction of a torch call's cost on the H200's
 * host (runtime/device/device_ids.py). `context` is made current for them and the caller's restored. */
static PyObject *queue_ids_copy(PyObject *self, PyObject *args)
{
    void *context, *stream, *event, *target, *flag;
    unsigned long long source, flag_source;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "O&O&O&O&KnO&K", parse_pointer, &context, parse_pointer, &stream, parse_pointer,
                          &event, parse_pointer, &target, &source, &bytes, parse_pointer, &flag, &flag_source))
        return NULL;
    if (bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "queue_ids_copy: bytes < 0");
        return NULL;
    }
    if (cuda_ready() != 0)
        return NULL;
    void *previous = NULL;
    cuda_result result = enter_context(context, &previous);
    if (result == 0)
        result = cuda.copy_to_host(target, source, (size_t)bytes, stream);
    if (result == 0 && flag_source)
        result = cuda.copy_to_host(flag, flag_source, sizeof(int32_t), stream);
    if (result == 0)
        result = cuda.event_record(event, stream);
    leave_context(context, previous);
    if (result != 0)
        return refuse_cuda("queueing the ids' copy", result);
    Py_RETURN_NONE;
}

/* stage_and_launch(context, events, graph, stream, *the arguments of stage): once each CUDA event
 * of `events` (a tuple of handles) has completed, `stage`; then, if the rows were staged and `graph`
 * (a CUDA graph exec) is not 0, the graph's launch on `stream`. A small start from device ids is
 * finished in this one call (runtime/device/device_ids.py): the wait for its ids and for the span's last copy,
 * its lookup, and the graph that copies its rows and decodes them, where each CUDA call through
 * torch costs the H200's host 5-10 us and a driver call 0.5-3 us (BENCHMARKS.md). `context` is
 * made current for it and the caller's restored. */
#define MAX_WAIT_EVENTS 4

static PyObject *stage_and_launch(PyObject *self, PyObject *args)
{
    if (PyTuple_GET_SIZE(args) < 4) {
        PyErr_SetString(PyExc_TypeError, "stage_and_launch(context, events, graph, stream, *stage arguments)");
        return NULL;
    }
    void *context, *graph, *stream, *events[MAX_WAIT_EVENTS];
    PyObject *event_handles = PyTuple_GET_ITEM(args, 1);
    if (!parse_pointer(PyTuple_GET_ITEM(args, 0), &context) || !parse_pointer(PyTuple_GET_ITEM(args, 2), &graph)
        || !parse_pointer(PyTuple_GET_ITEM(args, 3), &stream))
        return NULL;
    if (!PyTuple_Check(event_handles) || PyTuple_GET_SIZE(event_handles) > MAX_WAIT_EVENTS) {
        PyErr_Format(PyExc_ValueError, "stage_and_launch: events must be a tuple of at most %d handles",
                     MAX_WAIT_EVENTS);
        return NULL;
    }
    Py_ssize_t num_events = PyTuple_GET_SIZE(event_handles);
    for (Py_ssize_t k = 0; k < num_events; k++)
        if (!parse_pointer(PyTuple_GET_ITEM(event_handles, k), &events[k]))
            return NULL;
    if (cuda_ready() != 0)
        return NULL;
    PyObject *stage_args = PyTuple_GetSlice(args, 4, PyTuple_GET_SIZE(args));
    if (!stage_args)
        return NULL;
    stage_call *call = new_stage_call(stage_args);
    Py_DECREF(stage_args);
    if (!call)
        return NULL;
    int launched = 0;
    cuda_result result;
    Py_BEGIN_ALLOW_THREADS
    void *previous = NULL;
    result = enter_context(context, &previous);
    for (Py_ssize_t k = 0; k < num_events && result == 0; k++)
        result = cuda.event_synchronize(events[k]);
    if (result == 0) {
        run_stage(call);
        if (call->staged && graph) {
            result = cuda.graph_launch(graph, stream);
            launched = result == 0;
        }
    }
    leave_context(context, previous);
    Py_END_ALLOW_THREADS
    if (result != 0) {
        free_stage_call(call);
        return refuse_cuda("a device-ids lookup's CUDA wait or launch", result);
    }
    PyObject *staged = finish_stage(call);
    if (!staged)
        return NULL;
    return Py_BuildValue("NO", staged, launched ? Py_True : Py_False);
}

static PyObject *cached(PyObject *self, PyObject *args)
{
    PyObject *view_object, *slots_object;
    Py_ssize_t probes;
    if (!PyArg_ParseTuple(args, "OOn", &view_object, &slots_object, &probes))
        return NULL;
    table_view *view = as_table_view(view_object);
    if (!view)
        return NULL;
    if (probes < 2) {
        PyErr_SetString(PyExc_ValueError, "cached: probes must be >= 2");
        return NULL;
    }
    Py_buffer slots;
    if (get_buffer(slots_object, &slots, 0, sizeof(int64_t), "slots") != 0)
        return NULL;
    Py_ssize_t count = slots.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *slot = (const int64_t *)slots.buf;
    int resident = 1;
    for (Py_ssize_t k = 0; k < probes && count && resident == 1; k++) {
        int64_t s = slot[(count - 1) * k / (probes - 1)];
        if ((uint64_t)s >= (uint64_t)view->num_slots)
            continue;  /* left to copy_rows to refuse */
        resident = page_cached(row_address(view->data, s, view->page_size, view->rows_per_page, view->row_bytes));
    }
    PyBuffer_Release(&slots);
    if (resident < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(resident);
}

static PyMethodDef methods[] = {
    {"stage", stage, METH_VARARGS, "A request's slots and tier rows, and its cached disk rows staged."},
    {"stage_when", stage_when, METH_VARARGS, "stage on a thread of its own once two flags hold values."},
    {"stage_joined", stage_joined, METH_VARARGS,
     "Wait for (or cancel) a stage_when job: (what stage returns, whether it copied to the device)."},
    {"stage_job_checks", stage_job_checks, METH_VARARGS, "How often a stage_when job found its flags not yet set."},
    {"device_context", device_context, METH_VARARGS, "The CUDA primary context of a device, for stage_when."},
    {"queue_ids_copy", queue_ids_copy, METH_VARARGS, "A start's ids copy to pinned memory, its flag and event."},
    {"stage_and_launch", stage_and_launch, METH_VARARGS,
     "stage after CUDA events, then a CUDA graph's launch: ((disk, staged), launched)."},
    {"cached", cached, METH_VARARGS, "Whether a few rows spread over a request are in the page cache."},
    FAILURE_RECORD_METHODS
    HOSTCACHE_METHODS
    READAHEAD_METHODS
    STEPS_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    pthread_atfork(NULL, NULL, pool_after_fork);
    select_find_slots();
    if (guard_faults() != 0 || PyType_Ready(&table_view_type) != 0)
        return NULL;
    PyObject *created = PyModule_Create(&module);
    if (created && PyModule_AddObjectRef(created, "TableView", (PyObject *)&table_view_type) != 0)
        Py_CLEAR(created);
    return created;
}
