/* A failure record's state word (failure_record.c; its layout: runtime/failure_record.py): a writer
 * claims the record, writes its fields, then stores the state with release; a reader loads the state
 * with acquire before the fields. The step service's thread (steps.c) and Python's writers and
 * readers go through the same calls, so a reader on a weakly ordered CPU (aarch64) never reads a
 * state ahead of the fields it covers, and one writer alone fills a record. */
#ifndef PLE_PREP_FAILURE_RECORD_H
#define PLE_PREP_FAILURE_RECORD_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define RECORD_BYTES 512
#define RECORD_EMPTY 0
#define RECORD_BEING_WRITTEN 1
#define RECORD_STEP_FAILURE 2

/* Whether a buffer can hold a record: at least RECORD_BYTES, 8-byte aligned (its state word atomic). */
int record_buffer_fits(const Py_buffer *view);
/* 1 if the record was EMPTY and is now BEING_WRITTEN, for this caller alone; else 0. */
int record_claim_state(int32_t *state);
void record_store_state(int32_t *state, int32_t value);

PyObject *record_claim(PyObject *self, PyObject *args);
PyObject *record_state(PyObject *self, PyObject *args);

#define FAILURE_RECORD_METHODS \
    {"record_claim", record_claim, METH_VARARGS, "A failure record taken for writing if it was empty."}, \
    {"record_state", record_state, METH_VARARGS, "A failure record's state, loaded with acquire (stored with release)."},

#endif
