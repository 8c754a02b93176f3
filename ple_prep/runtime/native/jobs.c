#include <pthread.h>
#include <stdatomic.h>

#include "cuda.h"
#include "jobs.h"
#include "stage.h"

/* --- stage_when: the same stage, run on a thread of its own once a device is done with two
 * things, each signalled by a value it writes into pinned host memory: flags[0] = ids_value after
 * it copied the ids there (the same stream, so in that order), flags[1] = free_value after its
 * last read of `out` (the previous request's rows; free_value < 0: the caller knows that read is
 * done, nothing to wait for). The thread polls the flags, holding the pool's workers awake, for
 * HOLD_NS (a device usually copies the ids within tens of microseconds), then lets them sleep and
 * polls WAIT_SLEEP_NS apart, so the lookup runs while the caller goes on launching work. With a
 * device copy (below) it then queues the staged rows' copy to the device itself. stage_joined
 * waits for the thread and returns what stage returns and whether it copied. A job dropped
 * unjoined (its start abandoned) is cancelled: its thread stops waiting and stages nothing. */

#define HOLD_NS 1000000
#define WAIT_SLEEP_NS 20000

/* --- The copy of a staged request to a GPU, queued by the job's own thread through the CUDA
 * driver (libcuda, opened at the first device_context call): the moment the rows are staged,
 * without waking the Python thread that joins the job (a copy launched from Python costs that
 * thread 40-150 us on the H200's host, BENCHMARKS.md). The job copies the bytes from the first
 * staged row of `out` to the end of the request's `index` entries, which the caller lays out in one
 * pinned span (runtime/device/buffers.py), to the same offsets from `address`, on `stream`, after
 * `wait_event`, then records `done_event`. The thread sets relaxed capture mode so that another
 * thread's CUDA graph capture neither refuses these calls nor is broken by them. */

#define CUDA_CAPTURE_MODE_RELAXED 2

static void copy_staged(const stage_call *call, device_copy *copy)
{
    const stage_request *request = &call->request;
    const char *span = request->out;
    size_t low = (size_t)(call->out_rows - call->disk) * (size_t)request->row_bytes;
    size_t high = (size_t)((const char *)(request->index + request->count) - span);
    int mode = CUDA_CAPTURE_MODE_RELAXED;
    cuda_result result = cuda.set_context(copy->context);
    if (result == 0)
        result = cuda.exchange_capture_mode(&mode);
    if (result == 0)
        result = cuda.stream_wait_event(copy->stream, copy->wait_event, 0);
    if (result == 0)
        result = cuda.copy_to_device(copy->address + low, span + low, high - low, copy->stream);
    if (result == 0)
        result = cuda.event_record(copy->done_event, copy->stream);
    copy->result = result;
}

typedef struct {
    stage_call *call;
    Py_buffer flag;  /* held from stage_when until the job is joined or dropped: its thread polls it */
    const int32_t *flags;
    int32_t values[2];
    device_copy copy;
    _Atomic int cancelled;
    _Atomic uint64_t checks; /* reads of the flags that found them not yet holding their values */
    int joined;
    pthread_t thread;
} stage_job;

static int flags_hold_values(const stage_job *job)
{
    return __atomic_load_n(&job->flags[0], __ATOMIC_ACQUIRE) == job->values[0]
           && (job->values[1] < 0 || __atomic_load_n(&job->flags[1], __ATOMIC_ACQUIRE) == job->values[1]);
}

static void *stage_job_main(void *argument)
{
    stage_job *job = argument;
    uint64_t began = monotonic_ns();
    unsigned spins = 0;
    int holding = job->call->request.parts > 1;
    if (holding)
        pool_hold(1);
    while (!flags_hold_values(job)) {
        atomic_fetch_add_explicit(&job->checks, 1, memory_order_release);
        if (atomic_load_explicit(&job->cancelled, memory_order_relaxed))
            break;
        if (++spins % 64 != 0 || monotonic_ns() - began < HOLD_NS) {
            cpu_relax();
            continue;
        }
        if (holding)
            pool_hold(-1);
        holding = 0;
        struct timespec pause = {0, WAIT_SLEEP_NS};
        nanosleep(&pause, NULL);
    }
    if (holding)
        pool_hold(-1);
    if (!atomic_load_explicit(&job->cancelled, memory_order_relaxed)) {
        run_stage(job->call);
        if (job->copy.address && job->call->staged)
            copy_staged(job->call, &job->copy);
    }
    return NULL;
}

/* Wait for a job's thread (stopping it first with `cancel`); called with the GIL, released while
 * waiting. Without `cancel`, the caller finishes the call (finish_stage); with it, it is dropped. */
static void join_job(stage_job *job, int cancel)
{
    if (cancel)
        atomic_store_explicit(&job->cancelled, 1, memory_order_relaxed);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(job->thread, NULL);
    Py_END_ALLOW_THREADS
    job->joined = 1;
    PyBuffer_Release(&job->flag);
    if (cancel) {
        free_stage_call(job->call);
    }
}

static void stage_job_destroy(PyObject *capsule)
{
    stage_job *job = PyCapsule_GetPointer(capsule, "ple_prep.stage_job");
    if (!job)
        return;
    if (!job->joined)
        join_job(job, 1);
    PyMem_RawFree(job);
}

/* The device_copy of stage_when's `copy` argument: None, or (context, stream, wait_event, done_event,
 * address) as ints; 0 on success, -1 with an exception set. */
static int parse_device_copy(PyObject *object, device_copy *copy)
{
    *copy = (device_copy){0};
    if (object == Py_None)
        return 0;
    if (!PyArg_ParseTuple(object, "O&O&O&O&K;copy must be (context, stream, wait_event, done_event, address)",
                          parse_pointer, &copy->context, parse_pointer, &copy->stream, parse_pointer,
                          &copy->wait_event, parse_pointer, &copy->done_event, &copy->address))
        return -1;
    if (cuda_ready() != 0)
        return -1;
    if (!copy->address) {
        PyErr_SetString(PyExc_ValueError, "stage_when: a device copy needs a device address");
        return -1;
    }
    return 0;
}

PyObject *stage_when(PyObject *self, PyObject *args)
{
    if (PyTuple_GET_SIZE(args) < 4) {
        PyErr_SetString(PyExc_TypeError, "stage_when(flags, ids_value, free_value, copy, *stage arguments)");
        return NULL;
    }
    long values[2];
    for (int k = 0; k < 2; k++) {
        values[k] = PyLong_AsLong(PyTuple_GET_ITEM(args, 1 + k));
        if (values[k] == -1 && PyErr_Occurred())
            return NULL;
    }
    device_copy copy;
    if (parse_device_copy(PyTuple_GET_ITEM(args, 3), &copy) != 0)
        return NULL;
    Py_buffer flag;
    if (get_buffer(PyTuple_GET_ITEM(args, 0), &flag, 0, sizeof(int32_t), "flags") != 0)
        return NULL;
    if (flag.len != 2 * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "flags must be two int32");
        PyBuffer_Release(&flag);
        return NULL;
    }
    PyObject *stage_args = PyTuple_GetSlice(args, 4, PyTuple_GET_SIZE(args));
    if (!stage_args) {
        PyBuffer_Release(&flag);
        return NULL;
    }
    stage_call *call = new_stage_call(stage_args);
    Py_DECREF(stage_args);
    if (call && copy.address
        && (const char *)call->request.index < call->request.out + call->out_rows * call->request.row_bytes) {
        /* copy_staged copies from the staged rows up to the index's end: the index must follow. */
        PyErr_SetString(PyExc_ValueError, "stage_when: a device copy needs index after out in one buffer");
        free_stage_call(call);
        call = NULL;
    }
    stage_job *job = call ? PyMem_RawCalloc(1, sizeof(stage_job)) : NULL;
    PyObject *capsule = NULL;
    if (call && !job)
        PyErr_NoMemory();
    if (job) {
        /* The job holds the flags' buffer (and so the array) until it is joined or dropped. */
        *job = (stage_job){.call = call, .flag = flag, .flags = flag.buf,
                           .values = {(int32_t)values[0], (int32_t)values[1]}, .copy = copy};
        if (pthread_create(&job->thread, NULL, stage_job_main, job) != 0)
            PyErr_SetString(PyExc_OSError, "stage_when: cannot start a thread");
        else if (!(capsule = PyCapsule_New(job, "ple_prep.stage_job", stage_job_destroy))) {
            atomic_store_explicit(&job->cancelled, 1, memory_order_relaxed);
            pthread_join(job->thread, NULL);
        }
    }
    if (!capsule) {
        if (call) {
            free_stage_call(call);
        }
        PyMem_RawFree(job);
        PyBuffer_Release(&flag);
    }
    return capsule;
}

PyObject *stage_joined(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    int cancel = 0;
    if (!PyArg_ParseTuple(args, "O|p", &capsule, &cancel))
        return NULL;
    stage_job *job = PyCapsule_GetPointer(capsule, "ple_prep.stage_job");
    if (!job)
        return NULL;
    if (job->joined) {
        PyErr_SetString(PyExc_RuntimeError, "stage_joined: this job was joined already");
        return NULL;
    }
    join_job(job, cancel);
    if (cancel)
        Py_RETURN_NONE;
    /* The thread queues the copy exactly when asked and the rows were staged (copy_staged). */
    int copied = job->copy.address && job->call->staged;
    if (job->copy.result != 0) {
        free_stage_call(job->call);
        return refuse_cuda("the copy of the staged rows to the device", job->copy.result);
    }
    PyObject *staged = finish_stage(job->call);
    if (!staged)
        return NULL;
    PyObject *result = Py_BuildValue("OO", staged, copied ? Py_True : Py_False);
    Py_DECREF(staged);
    return result;
}

/* stage_job_checks(job) -> int: how often the job's thread has read its flags and found them not yet
 * holding its values (tests/test_gather.py waits for a read after a write instead of sleeping). */
PyObject *stage_job_checks(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule))
        return NULL;
    stage_job *job = PyCapsule_GetPointer(capsule, "ple_prep.stage_job");
    if (!job)
        return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(&job->checks, memory_order_acquire));
}
