/* Read-ahead's reads into the host cache on a reader of its own (readahead.c), for the read-ahead
 * thread of ple_prep/runtime/readahead.py. */
#ifndef PLE_PREP_READAHEAD_H
#define PLE_PREP_READAHEAD_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *readahead_new(PyObject *self, PyObject *args);
PyObject *readahead_fill(PyObject *self, PyObject *args);
PyObject *readahead_hold(PyObject *self, PyObject *args);
PyObject *readahead_stop(PyObject *self, PyObject *capsule);
PyObject *readahead_serve(PyObject *self, PyObject *args);
PyObject *readahead_progress(PyObject *self, PyObject *capsule);
PyObject *readahead_wait(PyObject *self, PyObject *args);

#define READAHEAD_METHODS \
    {"readahead_new", readahead_new, METH_VARARGS, "A read-ahead reader of a table file into its host cache."}, \
    {"readahead_fill", readahead_fill, METH_VARARGS, "Read a request's rows from a position on into the cache."}, \
    {"readahead_hold", readahead_hold, METH_VARARGS, "Count a demand read waiting (+1) or done (-1)."}, \
    {"readahead_stop", readahead_stop, METH_O, "Stop the fill in progress or about to begin (a cancel, a close)."}, \
    {"readahead_serve", readahead_serve, METH_VARARGS, "The request read ahead now (0: none) and its position."}, \
    {"readahead_progress", readahead_progress, METH_O, "(serial, done, stops): the request served, its place."}, \
    {"readahead_wait", readahead_wait, METH_VARARGS, "Wait until the request served has passed a position."},

#endif
