/* A table as the compiled runtime sees it (view.c): its mapping, geometry and rank index, checked
 * once when the table is opened and held (buffers and all) for as long as any call uses them. */
#ifndef PLE_PREP_VIEW_H
#define PLE_PREP_VIEW_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "../../core/native/buffers.h"

typedef struct {
    PyObject_HEAD
    held_buffers held; /* the mapping, the rank words and the placed rows' slots */
    const char *mapping, *data; /* the file's first byte, and the data region's */
    Py_ssize_t mapping_bytes, data_offset, page_size, rows_per_page, row_bytes, num_slots;
    int64_t first_row, num_rows, num_placed;
    const uint64_t *rank_words;
    const uint8_t *packed_slots;
} table_view;

extern PyTypeObject table_view_type;

/* `object` as a table view, or NULL with a TypeError. */
table_view *as_table_view(PyObject *object);

#endif
