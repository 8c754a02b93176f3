/* Buffer checks shared by both compiled modules (core/native/module.c, runtime/native/): the
 * callers' arrays are checked here, once, not in Python. */
#ifndef PLE_PREP_BUFFERS_H
#define PLE_PREP_BUFFERS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* A C-contiguous buffer of `item`-byte elements (an array of the right dtype's size), refused with
 * a ValueError naming it otherwise. */
int get_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t item, const char *name);

/* A table's page geometry, refused unless rows fit their pages (format/header.py checks the same
 * at open; this guards the pointer arithmetic of the callers). */
int check_geometry(Py_ssize_t data_offset, Py_ssize_t page_size, Py_ssize_t rows_per_page, Py_ssize_t row_bytes,
                   Py_ssize_t num_slots);

/* The buffers a call holds, released together on every way out. */
typedef struct {
    Py_buffer views[8];
    int held;
} held_buffers;

void release(held_buffers *held);
Py_buffer *hold(held_buffers *held, PyObject *object, int writable, Py_ssize_t item, const char *name);

#endif
