#include "buffers.h"

int get_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t item, const char *name)
{
    if (PyObject_GetBuffer(object, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) != 0) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError) && !PyErr_ExceptionMatches(PyExc_BufferError))
            return -1;
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s array", name, writable ? ", writable" : "");
        return -1;
    }
    if (view->itemsize != item) {
        PyErr_Format(PyExc_ValueError, "%s must be an array of %zd-byte items, not %zd-byte ones", name, item,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

int check_geometry(Py_ssize_t data_offset, Py_ssize_t page_size, Py_ssize_t rows_per_page,
                   Py_ssize_t row_bytes, Py_ssize_t num_slots)
{
    if (row_bytes <= 0 || rows_per_page <= 0 || rows_per_page * row_bytes > page_size || data_offset < 0
        || num_slots < 0) {
        PyErr_SetString(PyExc_ValueError, "bad table geometry");
        return -1;
    }
    return 0;
}

void release(held_buffers *held)
{
    while (held->held)
        PyBuffer_Release(&held->views[--held->held]);
}

Py_buffer *hold(held_buffers *held, PyObject *object, int writable, Py_ssize_t item, const char *name)
{
    Py_buffer *view = &held->views[held->held];
    if (get_buffer(object, view, writable, item, name) != 0)
        return NULL;
    held->held++;
    return view;
}
