/* The rank index's construction (rankindex.c), called from ple_prep/format/order.py, whose numpy
 * code is the fallback with the same results. */
#ifndef PLE_PREP_RANKINDEX_H
#define PLE_PREP_RANKINDEX_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *rank_bits(PyObject *self, PyObject *args);
PyObject *slots_by_rank(PyObject *self, PyObject *args);
PyObject *pack_slots(PyObject *self, PyObject *args);

#define RANKINDEX_METHODS \
    {"rank_bits", rank_bits, METH_VARARGS, "The rank index's bits and counts from a map (see rankindex.c)."}, \
    {"slots_by_rank", slots_by_rank, METH_VARARGS, "Each placed row's write chunk, rows ascending (see rankindex.c)."}, \
    {"pack_slots", pack_slots, METH_VARARGS, "The rank index's slots packed in place (see rankindex.c)."},

#endif
