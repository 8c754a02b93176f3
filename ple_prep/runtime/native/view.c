#include "view.h"

/* TableView(mapping, rank_lines, packed_slots, num_placed, slot_width, first_row, num_rows, data_offset,
 * page_size, rows_per_page, row_bytes, num_slots): runtime/gather.py builds one per table. */
static int view_init(table_view *self, PyObject *args, PyObject *kwargs)
{
    PyObject *mapping_object, *rank_lines_object, *packed_slots_object;
    long long num_placed, first_row, num_rows;
    int slot_width;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots;
    static char *names[] = {"mapping", "rank_lines", "packed_slots", "num_placed", "slot_width", "first_row",
                            "num_rows", "data_offset", "page_size", "rows_per_page", "row_bytes", "num_slots", NULL};
    if (self->held.held) {
        PyErr_SetString(PyExc_RuntimeError, "TableView: already built");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOLiLLnnnnn", names, &mapping_object, &rank_lines_object,
                                     &packed_slots_object, &num_placed, &slot_width, &first_row, &num_rows,
                                     &data_offset, &page_size, &rows_per_page, &row_bytes, &num_slots)
        || check_geometry(data_offset, page_size, rows_per_page, row_bytes, num_slots) != 0)
        return -1;
    Py_buffer *mapping, *rank_lines, *packed_slots;
    rank_index index;
    if (!(mapping = hold(&self->held, mapping_object, 0, 1, "mapping"))
        || !(rank_lines = hold(&self->held, rank_lines_object, 0, sizeof(uint64_t), "rank_lines"))
        || !(packed_slots = hold(&self->held, packed_slots_object, 0, sizeof(uint64_t), "packed_slots"))
        || rank_index_from(&index, rank_lines, packed_slots, num_placed, slot_width, num_rows, "TableView") != 0)
        goto refused;
    Py_ssize_t num_pages = (num_slots + rows_per_page - 1) / rows_per_page;
    const char *mismatch = first_row < 0 || num_rows < 0 || num_rows > num_slots ? "bad row counts"
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
                         .num_rows = num_rows, .index = index};
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
