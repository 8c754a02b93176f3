#include "view.h"

#include "../../core/native/rows.h"

/* TableView(mapping, rank_words, packed_slots, first_row, num_rows, data_offset, page_size,
 * rows_per_page, row_bytes, num_slots): runtime/gather.py builds one per table. */
static int view_init(table_view *self, PyObject *args, PyObject *kwargs)
{
    PyObject *mapping_object, *rank_words_object, *packed_slots_object;
    long long first_row, num_rows;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots;
    static char *names[] = {"mapping", "rank_words", "packed_slots", "first_row", "num_rows", "data_offset",
                            "page_size", "rows_per_page", "row_bytes", "num_slots", NULL};
    if (self->held.held) {
        PyErr_SetString(PyExc_RuntimeError, "TableView: already built");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOLLnnnnn", names, &mapping_object, &rank_words_object,
                                     &packed_slots_object, &first_row, &num_rows, &data_offset, &page_size,
                                     &rows_per_page, &row_bytes, &num_slots)
        || check_geometry(data_offset, page_size, rows_per_page, row_bytes, num_slots) != 0)
        return -1;
    Py_buffer *mapping, *rank_words, *packed_slots;
    if (!(mapping = hold(&self->held, mapping_object, 0, 1, "mapping"))
        || !(rank_words = hold(&self->held, rank_words_object, 0, sizeof(uint64_t), "rank_words"))
        || !(packed_slots = hold(&self->held, packed_slots_object, 0, 1, "packed_slots")))
        goto refused;
    Py_ssize_t num_pages = (num_slots + rows_per_page - 1) / rows_per_page;
    int64_t num_placed = rank_index_placed(rank_words->buf, rank_words->len, packed_slots->len, num_rows);
    const char *mismatch = first_row < 0 || num_rows < 0 || num_rows > num_slots ? "bad row counts"
        : num_placed < 0 ? "the rank index does not cover the table"
        : num_pages > (PY_SSIZE_T_MAX - data_offset) / page_size || data_offset + num_pages * page_size > mapping->len
            ? "the mapping is shorter than its pages" : NULL;
    if (mismatch) {
        PyErr_Format(PyExc_ValueError, "TableView: %s", mismatch);
        goto refused;
    }
    *self = (table_view){.ob_base = self->ob_base, .held = self->held, .mapping = mapping->buf,
                         .data = (const char *)mapping->buf + data_offset, .mapping_bytes = mapping->len,
                         .data_offset = data_offset, .page_size = page_size, .rows_per_page = rows_per_page,
                         .row_bytes = row_bytes, .num_slots = num_slots, .first_row = first_row,
                         .num_rows = num_rows, .num_placed = num_placed, .rank_words = rank_words->buf,
                         .packed_slots = packed_slots->buf};
    return 0;
refused:
    release(&self->held);
    return -1;
}

static void view_dealloc(table_view *self)
{
    release(&self->held);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyTypeObject table_view_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ple_prep.runtime._native.TableView",
    .tp_basicsize = sizeof(table_view),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A table's mapping, geometry and rank index, checked once, for stage, stage_when and cached.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)view_init,
    .tp_dealloc = (destructor)view_dealloc,
};

table_view *as_table_view(PyObject *object)
{
    if (!PyObject_TypeCheck(object, &table_view_type) || !((table_view *)object)->held.held) {
        PyErr_SetString(PyExc_TypeError, "expected a built TableView");
        return NULL;
    }
    return (table_view *)object;
}
