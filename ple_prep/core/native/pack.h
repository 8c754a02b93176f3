/* The planner's page packing (pack.c), called from ple_prep/offline/planner.py, whose Python loop
 * is the fallback with the same pieces. */
#ifndef PLE_PREP_PACK_H
#define PLE_PREP_PACK_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *pack_groups(PyObject *self, PyObject *args);

#define PACK_METHODS \
    {"pack_groups", pack_groups, METH_VARARGS, "Groups of rows ordered into pages (see pack.c)."},

#endif
