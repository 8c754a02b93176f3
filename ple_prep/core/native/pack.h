/* The planner's loops over groups (pack.c), called from ple_prep/offline/planner.py, whose numpy
 * and Python code is the fallback with the same results. */
#ifndef PLE_PREP_PACK_H
#define PLE_PREP_PACK_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *pack_groups(PyObject *self, PyObject *args);
PyObject *take_new_rows(PyObject *self, PyObject *args);

#define PACK_METHODS \
    {"pack_groups", pack_groups, METH_VARARGS, "Groups of rows ordered into pages (see pack.c)."}, \
    {"take_new_rows", take_new_rows, METH_VARARGS, "Each group's rows no hotter group read (see pack.c)."},

#endif
