/* Stream memory operations (memops.h) and the driver calls of a step's device side: the
 * functions of ple_prep.runtime._native that runtime/device/steps.py queues on its streams. */
#include <dlfcn.h>
#include <pthread.h>

#include "cuda.h"
#include "memops.h"
#include "steps.h"

/* Stream memory operations: cuStreamWriteValue32 and cuStreamWaitValue32, beside cuda.c's table. */
cuda_result (*write_value32)(void *, unsigned long long, uint32_t, unsigned);
cuda_result (*wait_value32)(void *, unsigned long long, uint32_t, unsigned);
static pthread_once_t memops_once = PTHREAD_ONCE_INIT;

static void load_memops(void)
{
    void *library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!library)
        return;
    write_value32 = (cuda_result(*)(void *, unsigned long long, uint32_t, unsigned))dlsym(library,
                                                                                          "cuStreamWriteValue32_v2");
    wait_value32 = (cuda_result(*)(void *, unsigned long long, uint32_t, unsigned))dlsym(library,
                                                                                         "cuStreamWaitValue32_v2");
}

int memops_ready(void)
{
    if (cuda_ready() != 0)
        return -1;
    pthread_once(&memops_once, load_memops);
    if (write_value32 && wait_value32)
        return 0;
    PyErr_SetString(PyExc_OSError, "the CUDA driver has no stream memory operations (cuStreamWriteValue32_v2)");
    return -1;
}

/* stream_write_value(stream, address, value) and stream_wait_value(stream, address, value): a
 * stream memory operation on the current context's `stream` (captured where it captures): write
 * the int32 `value` at device-visible `address`, or wait until it holds `value`. */
static PyObject *memop(PyObject *args, int wait)
{
    void *stream;
    unsigned long long address;
    unsigned int value;
    if (!PyArg_ParseTuple(args, "O&KI", parse_pointer, &stream, &address, &value) || memops_ready() != 0)
        return NULL;
    cuda_result result = wait ? wait_value32(stream, address, value, 0 /* CU_STREAM_WAIT_VALUE_GEQ */)
                              : write_value32(stream, address, value, 0);
    if (result != 0)
        return PyErr_Format(PyExc_RuntimeError, "cuStream%sValue32 failed (CUDA error %d)", wait ? "Wait" : "Write",
                            result);
    Py_RETURN_NONE;
}

PyObject *stream_write_value(PyObject *self, PyObject *args)
{
    return memop(args, 0);
}

/* queue_step_start(stream, target, source, bytes, flag, count): on `stream` (captured where it
 * captures), the copy of `bytes` from device address `source` into pinned `target`, then the write
 * of `count` into pinned int32 `flag`: a step's start in two driver calls, a fraction of a torch
 * copy's cost on the H200's host (BENCHMARKS.md). */
PyObject *queue_step_start(PyObject *self, PyObject *args)
{
    void *stream, *target;
    unsigned long long source, flag;
    Py_ssize_t bytes;
    unsigned int count;
    if (!PyArg_ParseTuple(args, "O&O&KnKI", parse_pointer, &stream, parse_pointer, &target, &source, &bytes, &flag,
                          &count) || memops_ready() != 0)
        return NULL;
    if (bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "queue_step_start: bytes < 0");
        return NULL;
    }
    cuda_result result = cuda.copy_to_host(target, source, (size_t)bytes, stream);
    if (result == 0)
        result = write_value32(stream, flag, count, 0);
    if (result != 0)
        return PyErr_Format(PyExc_RuntimeError, "queueing a step's start failed (CUDA error %d)", result);
    Py_RETURN_NONE;
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

PyObject *stream_wait_value(PyObject *self, PyObject *args)
{
    return memop(args, 1);
}
