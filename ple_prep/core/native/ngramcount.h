/* The n-gram hash and the profile's counting loops (ngramcount.c), called from ple_prep/ngram.py
 * and ple_prep/offline/profile.py, each with a numpy fallback giving the same bits. */
#ifndef PLE_PREP_NGRAMCOUNT_H
#define PLE_PREP_NGRAMCOUNT_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *ngram_mix(PyObject *self, PyObject *args);
PyObject *run_lengths(PyObject *self, PyObject *args);
PyObject *merge_counts(PyObject *self, PyObject *args);
PyObject *head_rows(PyObject *self, PyObject *args);

#define NGRAMCOUNT_METHODS                                                                                    \
    {"ngram_mix", ngram_mix, METH_VARARGS, "The mixed n-gram hashes of token ids, one row per order."},       \
    {"run_lengths", run_lengths, METH_VARARGS, "Distinct values of a sorted array and their counts."},       \
    {"merge_counts", merge_counts, METH_VARARGS, "Two sorted key/count runs merged, equal keys summed."},    \
    {"head_rows", head_rows, METH_VARARGS, "One hash head's rows of counted groups, counts summed per row."},

#endif
