/* The step service (steps.c): a thread that serves a device's lookups which the device itself
 * starts and waits for through flags in pinned memory, so that a CUDA graph can hold every step. */
#ifndef PLE_PREP_STEPS_H
#define PLE_PREP_STEPS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *step_service(PyObject *self, PyObject *args);
PyObject *step_service_stop(PyObject *self, PyObject *args);
PyObject *step_service_stats(PyObject *self, PyObject *args);
PyObject *step_service_error(PyObject *self, PyObject *args);
PyObject *new_step_queue(PyObject *self, PyObject *args);
PyObject *queue_step_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *queue_step_fetch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *queue_step_finish(PyObject *self, PyObject *args);
PyObject *step_handles(PyObject *self, PyObject *args);
PyObject *drop_handles(PyObject *self, PyObject *args);
PyObject *step_kernels(PyObject *self, PyObject *args);
PyObject *launch_graph(PyObject *self, PyObject *args);

/* The module's method table entries (module.c). */
#define STEPS_METHODS \
    {"step_service", step_service, METH_VARARGS, "A thread serving the steps a device starts and waits for."}, \
    {"step_service_stop", step_service_stop, METH_VARARGS, "Stop and join a step service's thread."}, \
    {"step_service_stats", step_service_stats, METH_VARARGS, "A step service's counters since its start."}, \
    {"step_service_error", step_service_error, METH_VARARGS, "A step service's first failure since the last."}, \
    {"step_queue", new_step_queue, METH_VARARGS, "A step lookup's fixed addresses, for its start and fetch."}, \
    {"queue_step_start", (PyCFunction)(void (*)(void))queue_step_start, METH_FASTCALL, \
     "A step's ids copy to pinned memory and its request."}, \
    {"queue_step_fetch", (PyCFunction)(void (*)(void))queue_step_fetch, METH_FASTCALL, \
     "A step's wait for its staged rows, their copy, and an eager finish's graph."}, \
    {"queue_step_finish", queue_step_finish, METH_VARARGS, "A step's side stream joined to the caller's."}, \
    {"step_handles", step_handles, METH_VARARGS, "A step lookup's own CUDA streams and events."}, \
    {"drop_handles", drop_handles, METH_VARARGS, "step_handles' streams and events, step_kernels' modules, destroyed."}, \
    {"step_kernels", step_kernels, METH_VARARGS, "The step kernels' PTX loaded into a context: module and kernels."}, \
    {"launch_graph", launch_graph, METH_VARARGS, "cuGraphLaunch of a CUDA graph exec on a stream."},

#endif
