/* Stream memory operations (memops.h) and the driver calls of a step's device side: the
 * functions of ple_prep.runtime._native that runtime/device/steps.py queues on its streams. */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "cuda.h"
#include "memops.h"
#include "steps.h"

/* Stream memory operations: cuStreamWriteValue32 and cuStreamBatchMemOp, beside cuda.c's table. */
cuda_result (*write_value32)(void *, unsigned long long, uint32_t, unsigned);

/* One operation of cuStreamBatchMemOp: CUstreamBatchMemOpParams's layout for a 32-bit wait or write. */
typedef union {
    struct {
        unsigned operation; /* CU_STREAM_MEM_OP_WAIT_VALUE_32 (1) or _WRITE_VALUE_32 (2) */
        unsigned long long address, value;
        unsigned flags;
        unsigned long long alias;
    } value;
    unsigned long long pad[6];
} stream_memop;
enum { WAIT_VALUE_32 = 1, WRITE_VALUE_32 = 2 };
_Static_assert(sizeof(stream_memop) == 48 && offsetof(stream_memop, value.address) == 8
                   && offsetof(stream_memop, value.value) == 16 && offsetof(stream_memop, value.flags) == 24
                   && offsetof(stream_memop, value.alias) == 32,
               "stream_memop must match CUstreamBatchMemOpParams");
static cuda_result (*batch_memops)(void *, unsigned, stream_memop *, unsigned);
static pthread_once_t memops_once = PTHREAD_ONCE_INIT;

static void load_memops(void)
{
    void *library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!library)
        return;
    write_value32 = (cuda_result(*)(void *, unsigned long long, uint32_t, unsigned))dlsym(library,
                                                                                          "cuStreamWriteValue32_v2");
    batch_memops = (cuda_result(*)(void *, unsigned, stream_memop *, unsigned))dlsym(library, "cuStreamBatchMemOp_v2");
}

int memops_ready(void)
{
    if (cuda_ready() != 0)
        return -1;
    pthread_once(&memops_once, load_memops);
    if (write_value32 && batch_memops)
        return 0;
    PyErr_SetString(PyExc_OSError,
                    "the CUDA driver has no stream memory operations (cuStreamWriteValue32_v2, cuStreamBatchMemOp_v2)");
    return -1;
}

static void set_memop(stream_memop *operation, unsigned kind, unsigned long long address, uint32_t value)
{
    memset(operation, 0, sizeof(*operation));
    operation->value.operation = kind;
    operation->value.address = address;
    operation->value.value = value;
}

/* Unless request_flag is 0, the write of `count` into it (the request); unless arrived_flag is 0, the
 * write of 1 into it (the device's arrival at the finish), reset after the wait (the thread reads it
 * before it stores the ready flag); the wait until the service thread's host store of 1 into
 * ready_flag, its reset to 0 and the copy of `bytes` staged rows and index from pinned
 * `source` to device `target`, on `stream`. The writes and the wait go in one driver call: each call
 * costs the host microseconds (BENCHMARKS.md). The wait is released by the host alone, never by
 * other device work: a wait that other queued device work must release can hang where their streams
 * share one of the device's hardware queues (docs/RUNTIME.md, "A step in one CUDA graph"). */
static cuda_result queue_fetch(void *stream, unsigned long long request_flag, uint32_t count,
                               unsigned long long arrived_flag, unsigned long long ready_flag,
                               unsigned long long target, const void *source, Py_ssize_t bytes)
{
    stream_memop operations[5];
    unsigned used = 0;
    if (request_flag)
        set_memop(&operations[used++], WRITE_VALUE_32, request_flag, count);
    if (arrived_flag)
        set_memop(&operations[used++], WRITE_VALUE_32, arrived_flag, 1);
    set_memop(&operations[used++], WAIT_VALUE_32, ready_flag, 1); /* flags 0: CU_STREAM_WAIT_VALUE_GEQ */
    set_memop(&operations[used++], WRITE_VALUE_32, ready_flag, 0);
    if (arrived_flag)
        set_memop(&operations[used++], WRITE_VALUE_32, arrived_flag, 0);
    cuda_result result = batch_memops(stream, used, operations, 0);
    if (result == 0 && bytes > 0)
        result = cuda.copy_to_device(target, source, (size_t)bytes, stream);
    return result;
}

/* Whether `stream` is being captured (an invalidated capture counts: its calls fail there). */
static cuda_result capturing(void *stream, int *status)
{
    cuda_result result = cuda.stream_is_capturing(stream, status);
    *status = *status != 0;
    return result;
}

/* A step lookup's fixed addresses, so that a step's start and fetch pass only what changes: each
 * argument parsed costs the host time on every step, most in the first call after an idle wait,
 * whose caches are cold (docs/benchmark-history.md, "A start that passes the helper only what changes"). */
typedef struct {
    void *side, *fork;                 /* the lookup's side stream and its fork event */
    void *ids_target;                  /* the pinned host copy of a step's ids */
    unsigned long long request_flag, ready_flag, arrived_flag;
    unsigned long long span_device;    /* the device span (DeviceBuffers.span_of's layout), and its pinned mirror */
    char *span_host;
    Py_ssize_t capacity, row_bytes, index_at;
    /* step_kernels.cu's kernels (NULL: not loaded), the two counters they keep in device memory (and a
     * third word, the arrival of a dropped step's fetch), and the most ids a step may have to be served by them rather than by the side stream. */
    void *request_kernel, *fetch_kernel;
    unsigned long long counters;
    Py_ssize_t kernel_max_ids;
} step_queue;
#define STEP_QUEUE_CAPSULE "ple_prep.step_queue"

static void step_queue_destroy(PyObject *capsule)
{
    PyMem_Free(PyCapsule_GetPointer(capsule, STEP_QUEUE_CAPSULE));
}

/* step_queue(side, fork, ids_target, request_flag, ready_flag, arrived_flag, span_device, span_host,
 * capacity, row_bytes, index_at, request_kernel, fetch_kernel, counters, kernel_max_ids) -> a capsule
 * holding them (the handles stay the caller's: step_handles, step_kernels). */
PyObject *new_step_queue(PyObject *self, PyObject *args)
{
    step_queue made;
    if (!PyArg_ParseTuple(args, "O&O&O&KKKKO&nnnO&O&Kn", parse_pointer, &made.side, parse_pointer, &made.fork,
                          parse_pointer, &made.ids_target, &made.request_flag, &made.ready_flag, &made.arrived_flag,
                          &made.span_device, parse_pointer, &made.span_host, &made.capacity, &made.row_bytes,
                          &made.index_at, parse_pointer, &made.request_kernel, parse_pointer, &made.fetch_kernel,
                          &made.counters, &made.kernel_max_ids))
        return NULL;
    if (made.capacity < 1 || made.row_bytes < 1 || made.index_at < made.capacity * made.row_bytes) {
        PyErr_SetString(PyExc_ValueError, "step_queue: the span's layout is inconsistent");
        return NULL;
    }
    if (made.kernel_max_ids > 0 && (!made.request_kernel || !made.fetch_kernel || !made.counters)) {
        PyErr_SetString(PyExc_ValueError, "step_queue: kernel_max_ids without the kernels and their counters");
        return NULL;
    }
    step_queue *queue = PyMem_Malloc(sizeof(*queue));
    if (!queue)
        return PyErr_NoMemory();
    *queue = made;
    PyObject *capsule = PyCapsule_New(queue, STEP_QUEUE_CAPSULE, step_queue_destroy);
    if (!capsule)
        PyMem_Free(queue);
    return capsule;
}

/* A fast call's queue (its first argument), raw `stream` (its second) and `count` (its last). */
static step_queue *parse_step_call(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t wanted, const char *name,
                                   void **stream, Py_ssize_t *count)
{
    if (nargs != wanted) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, wanted, nargs);
        return NULL;
    }
    step_queue *queue = PyCapsule_GetPointer(args[0], STEP_QUEUE_CAPSULE);
    if (!queue || !parse_pointer(args[1], stream))
        return NULL;
    *count = PyLong_AsSsize_t(args[nargs - 1]);
    if (*count == -1 && PyErr_Occurred())
        return NULL;
    if (*count < 1 || *count >= queue->capacity) { /* the span's first staging row is never staged into */
        PyErr_Format(PyExc_ValueError, "%s: %zd ids, this lookup takes 1 to %zd", name, *count, queue->capacity - 1);
        return NULL;
    }
    if (memops_ready() != 0)
        return NULL;
    return queue;
}

/* The staged span of `count` ids: their rows, from the span's end, and their index. */
static void span_of(const step_queue *queue, Py_ssize_t count, Py_ssize_t *low, Py_ssize_t *bytes)
{
    *low = (queue->capacity - count) * queue->row_bytes;
    *bytes = queue->index_at + 4 * count - *low;
}

/* That span to the device, after the wait for READY and its reset, on `stream`; first the request's
 * write with `request` (a start beside the caller's work), the arrival's with `arrival` (a finish:
 * not a drop, whose step never reached the PLE layer). */
static cuda_result queue_span_fetch(const step_queue *queue, void *stream, Py_ssize_t count, int request,
                                    int arrival)
{
    Py_ssize_t low, bytes;
    span_of(queue, count, &low, &bytes);
    return queue_fetch(stream, request ? queue->request_flag : 0, (uint32_t)count, arrival ? queue->arrived_flag : 0,
                       queue->ready_flag, queue->span_device + (unsigned long long)low, queue->span_host + low, bytes);
}

/* step_kernels.cu's launches: KERNEL_THREADS a block, a block per REQUEST_IDS_PER_BLOCK ids or
 * FETCH_BYTES_PER_BLOCK bytes of the span, at most KERNEL_MAX_BLOCKS (each of the fetch's blocks polls
 * the ready flag over the bus). */
enum {
    KERNEL_THREADS = 256, REQUEST_IDS_PER_BLOCK = 1024, FETCH_BYTES_PER_BLOCK = 4096, KERNEL_MAX_BLOCKS = 128
};

static unsigned blocks_for(Py_ssize_t units, Py_ssize_t per_block)
{
    Py_ssize_t blocks = (units + per_block - 1) / per_block;
    return (unsigned)(blocks < 1 ? 1 : blocks > KERNEL_MAX_BLOCKS ? KERNEL_MAX_BLOCKS : blocks);
}

static cuda_result launch_request(const step_queue *queue, void *stream, unsigned long long ids, Py_ssize_t count)
{
    unsigned long long host_ids = (unsigned long long)(uintptr_t)queue->ids_target, done = queue->counters;
    unsigned long long request = queue->request_flag;
    unsigned ids_count = (unsigned)count;
    void *parameters[] = {&ids, &host_ids, &done, &request, &ids_count};
    return cuda.launch_kernel(queue->request_kernel, blocks_for(count, REQUEST_IDS_PER_BLOCK), 1, 1, KERNEL_THREADS,
                              1, 1, 0, stream, parameters, NULL);
}

/* step_fetch on `stream`; without `arrival` (a drop) its arrival goes to the counters' third word. */
static cuda_result launch_fetch(const step_queue *queue, void *stream, Py_ssize_t count, int arrival)
{
    Py_ssize_t low, bytes;
    span_of(queue, count, &low, &bytes);
    unsigned long long ready = queue->ready_flag, seen = queue->counters + 4;
    unsigned long long arrived = arrival ? queue->arrived_flag : queue->counters + 8;
    unsigned long long source = (unsigned long long)(uintptr_t)(queue->span_host + low);
    unsigned long long target = queue->span_device + (unsigned long long)low, size = (unsigned long long)bytes;
    void *parameters[] = {&ready, &arrived, &seen, &source, &target, &size};
    return cuda.launch_kernel(queue->fetch_kernel, blocks_for(bytes, FETCH_BYTES_PER_BLOCK), 1, 1, KERNEL_THREADS, 1,
                              1, 0, stream, parameters, NULL);
}

/* The side stream made to wait for what `stream` queued so far (a record of the fork event there): work
 * then queued on the side stream runs beside `stream`'s later work, until queue_step_finish joins it. */
static cuda_result fork_side(const step_queue *queue, void *stream)
{
    cuda_result result = cuda.event_record(queue->fork, stream);
    return result == 0 ? cuda.stream_wait_event(queue->side, queue->fork, 0) : result;
}

/* queue_step_start(queue, stream, ids, beside_in_capture, count) -> whether it went beside: a step's
 * start in one call of the helper, a fraction of torch calls' cost on the H200's host (BENCHMARKS.md).
 * The copy of `count` int64 ids from device address `ids` into the queue's pinned ids and the write of
 * `count` into its request flag. Up to the queue's kernel_max_ids ids, step_request does both on
 * `stream`, and the fetch (queue_step_fetch) is step_fetch there: on a side stream they cost a FULL
 * graph's step more, not less (docs/benchmark-history.md, "The step kernels beside the work"). Else,
 * where `stream` is not being captured, or is and `beside_in_capture` (the finish comes in the same
 * graph), they go on the side stream after a record of the fork event on `stream` (beside the
 * caller's work that follows on `stream`; joined again by queue_step_finish), followed there by the
 * fetch of the staged span; else on `stream`, and the finish queues the fetch (queue_step_fetch). */
PyObject *queue_step_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream;
    Py_ssize_t count;
    step_queue *queue = parse_step_call(args, nargs, 5, "queue_step_start", &stream, &count);
    if (!queue)
        return NULL;
    unsigned long long ids = PyLong_AsUnsignedLongLong(args[2]);
    int beside_in_capture = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred() || beside_in_capture < 0)
        return NULL;
    int beside = 0;
    cuda_result result = 0;
    if (count <= queue->kernel_max_ids)
        result = launch_request(queue, stream, ids, count);
    else {
        result = capturing(stream, &beside);
        beside = !beside || beside_in_capture;
        if (result == 0 && beside)
            result = fork_side(queue, stream);
        void *on = beside ? queue->side : stream;
        if (result == 0)
            result = cuda.copy_to_host(queue->ids_target, ids, (size_t)count * 8, on);
        if (result == 0 && beside)
            result = queue_span_fetch(queue, on, count, 1, 0);
        else if (result == 0)
            result = write_value32(on, queue->request_flag, (uint32_t)count, 0);
    }
    if (result != 0)
        return PyErr_Format(PyExc_RuntimeError, "queueing a step's start failed (CUDA error %d)", result);
    return PyBool_FromLong(beside);
}

/* queue_step_fetch(queue, stream, graph, arrival, count) -> whether `stream` is being captured: the
 * fetch of a start that did not go beside, on `stream` (step_fetch up to kernel_max_ids ids, else the
 * memory operations' wait and the copy engine's copy), with the device's arrival marked where
 * `arrival` (a finish, not a drop), then, where `stream` is not captured and `graph` is not 0, that
 * graph exec launched on it (an eager finish's device half in the same call). */
PyObject *queue_step_fetch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream, *graph;
    Py_ssize_t count;
    step_queue *queue = parse_step_call(args, nargs, 5, "queue_step_fetch", &stream, &count);
    if (!queue || !parse_pointer(args[2], &graph))
        return NULL;
    int arrival = PyObject_IsTrue(args[3]), captured = 0;
    if (arrival < 0)
        return NULL;
    cuda_result result = count <= queue->kernel_max_ids ? launch_fetch(queue, stream, count, arrival)
                                                         : queue_span_fetch(queue, stream, count, 0, arrival);
    if (result == 0)
        result = capturing(stream, &captured);
    if (result == 0 && graph && !captured)
        result = cuda.graph_launch(graph, stream);
    if (result != 0)
        return PyErr_Format(PyExc_RuntimeError, "queueing a step's fetch failed (CUDA error %d)", result);
    return PyBool_FromLong(captured);
}

/* queue_step_finish(stream, side, done, arrived_flag, graph) -> whether `stream` is being captured:
 * `stream` waits for everything queued on `side` so far (a record of event `done` there; a capture may
 * not end with a side stream unjoined); unless arrived_flag is 0, with the write of 1 into it before
 * that wait (the device's arrival) and of 0 after (the thread reads it before it stores the ready
 * flag, so it never stays for the next step); then, where `stream` is not captured and `graph` is not
 * 0, that graph exec launched on it (an eager finish's device half in one call). */
PyObject *queue_step_finish(PyObject *self, PyObject *args)
{
    void *stream, *side, *done, *graph;
    unsigned long long arrived_flag;
    int captured = 0;
    if (!PyArg_ParseTuple(args, "O&O&O&KO&", parse_pointer, &stream, parse_pointer, &side, parse_pointer, &done,
                          &arrived_flag, parse_pointer, &graph)
        || (arrived_flag ? memops_ready() : cuda_ready()) != 0)
        return NULL;
    cuda_result result = arrived_flag ? write_value32(stream, arrived_flag, 1, 0) : 0;
    if (result == 0)
        result = cuda.event_record(done, side);
    if (result == 0)
        result = cuda.stream_wait_event(stream, done, 0);
    if (result == 0 && arrived_flag)
        result = write_value32(stream, arrived_flag, 0, 0);
    if (result == 0)
        result = capturing(stream, &captured);
    if (result == 0 && graph && !captured)
        result = cuda.graph_launch(graph, stream);
    if (result != 0)
        return PyErr_Format(PyExc_RuntimeError, "joining a step's side stream failed (CUDA error %d)", result);
    return PyBool_FromLong(captured);
}

/* The streams (handles[0]), events (handles[1]) and modules (handles[2], if not NULL) the tuples hold
 * as ints destroyed (the caller made their context current); items not set yet, or not ints, passed over. */
static void destroy_handles(PyObject *const handles[3])
{
    for (int kind = 0; kind < 3; kind++)
        for (Py_ssize_t k = 0; handles[kind] && k < PyTuple_GET_SIZE(handles[kind]); k++) {
            PyObject *number = PyTuple_GET_ITEM(handles[kind], k);
            void *handle = number ? PyLong_AsVoidPtr(number) : NULL;
            if (handle)
                kind == 0 ? cuda.stream_destroy(handle) : kind == 1 ? cuda.event_destroy(handle)
                                                                    : cuda.module_unload(handle);
        }
}

/* step_handles(context, streams, events) -> (streams, events): tuples of new CUDA streams
 * (non-blocking, as torch's) and events (no timing) of `context`, as ints: a step lookup's own, so
 * that no other work (torch hands its pooled streams out again) queues behind its service's copies
 * or its side stream's waits, or is captured with them. */
PyObject *step_handles(PyObject *self, PyObject *args)
{
    void *context, *previous;
    int counts[2];
    if (!PyArg_ParseTuple(args, "O&ii", parse_pointer, &context, &counts[0], &counts[1]) || cuda_ready() != 0)
        return NULL;
    PyObject *made[3] = {PyTuple_New(counts[0] < 0 ? 0 : counts[0]), PyTuple_New(counts[1] < 0 ? 0 : counts[1]),
                         NULL};
    cuda_result result = made[0] && made[1] ? enter_context(context, &previous) : -1;
    int entered = result == 0;
    for (int kind = 0; kind < 2 && result == 0; kind++)
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(made[kind]) && result == 0; k++) {
            void *handle = NULL;
            result = kind == 0 ? cuda.stream_create(&handle, 0x1 /* CU_STREAM_NON_BLOCKING */)
                               : cuda.event_create(&handle, 0x2 /* CU_EVENT_DISABLE_TIMING */);
            PyObject *number = result == 0 ? PyLong_FromVoidPtr(handle) : NULL;
            if (number)
                PyTuple_SET_ITEM(made[kind], k, number);
            else if (result == 0) {
                kind == 0 ? cuda.stream_destroy(handle) : cuda.event_destroy(handle);
                result = -1;
            }
        }
    if (result != 0)
        destroy_handles(made);
    if (entered)
        leave_context(context, previous);
    if (result == 0)
        return Py_BuildValue("NN", made[0], made[1]);
    Py_XDECREF(made[0]);
    Py_XDECREF(made[1]);
    if (PyErr_Occurred())
        return NULL;
    return refuse_cuda("creating a step lookup's streams and events", result);
}

/* drop_handles(context, streams, events, modules): step_handles' streams (once their queued work is
 * done) and events destroyed, and step_kernels' modules unloaded (0: none loaded); nothing where the
 * context is gone (at exit the driver frees them itself). */
PyObject *drop_handles(PyObject *self, PyObject *args)
{
    void *context, *previous;
    PyObject *handles[3];
    if (!PyArg_ParseTuple(args, "O&O!O!O!", parse_pointer, &context, &PyTuple_Type, &handles[0], &PyTuple_Type,
                          &handles[1], &PyTuple_Type, &handles[2]) || cuda_ready() != 0)
        return NULL;
    if (enter_context(context, &previous) != 0)
        Py_RETURN_NONE;
    destroy_handles(handles);
    leave_context(context, previous);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* step_kernels(context, ptx) -> (module, step_request, step_fetch): step_kernels.cu's PTX (bytes)
 * loaded into `context` (the driver compiles it for the device) and its two kernels, as ints; a
 * RuntimeError naming the driver's error where it cannot (a driver older than the PTX, a device it
 * has no code for). */
PyObject *step_kernels(PyObject *self, PyObject *args)
{
    void *context, *previous, *module = NULL, *functions[2] = {NULL, NULL};
    const char *ptx;
    if (!PyArg_ParseTuple(args, "O&y", parse_pointer, &context, &ptx) || cuda_ready() != 0)
        return NULL;
    cuda_result result = enter_context(context, &previous);
    int entered = result == 0;
    if (result == 0)
        result = cuda.module_load_data(&module, ptx);
    if (result == 0)
        result = cuda.module_get_function(&functions[0], module, "step_request");
    if (result == 0)
        result = cuda.module_get_function(&functions[1], module, "step_fetch");
    if (result != 0 && module)
        cuda.module_unload(module);
    if (entered)
        leave_context(context, previous);
    if (result != 0)
        return refuse_cuda("loading the step kernels (step_kernels.ptx)", result);
    return Py_BuildValue("NNN", PyLong_FromVoidPtr(module), PyLong_FromVoidPtr(functions[0]),
                         PyLong_FromVoidPtr(functions[1]));
}

/* launch_graph(graph_exec, stream): cuGraphLaunch, for an eager step's finish captured once per size. */
PyObject *launch_graph(PyObject *self, PyObject *args)
{
    void *graph, *stream;
    if (!PyArg_ParseTuple(args, "O&O&", parse_pointer, &graph, parse_pointer, &stream) || cuda_ready() != 0)
        return NULL;
    cuda_result result = cuda.graph_launch(graph, stream);
    if (result != 0)
        return PyErr_Format(PyExc_RuntimeError, "a CUDA graph's launch failed (CUDA error %d)", result);
    Py_RETURN_NONE;
}
