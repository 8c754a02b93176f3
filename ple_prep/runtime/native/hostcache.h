/* The host cache's loops (hostcache.c), functions of ple_prep.runtime._native. */
#ifndef PLE_PREP_HOSTCACHE_H
#define PLE_PREP_HOSTCACHE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *hostcache_lookup(PyObject *self, PyObject *args);
PyObject *hostcache_probe(PyObject *self, PyObject *args);
PyObject *hostcache_admit(PyObject *self, PyObject *args);

#define HOSTCACHE_METHODS \
    {"hostcache_lookup", hostcache_lookup, METH_VARARGS, "Copy a request's cached rows out; list the slots missed."}, \
    {"hostcache_probe", hostcache_probe, METH_VARARGS, "Mark a request's cached slots referenced; list the others."}, \
    {"hostcache_admit", hostcache_admit, METH_VARARGS, "Admit rows into the host cache by per-set clock."},

#endif
