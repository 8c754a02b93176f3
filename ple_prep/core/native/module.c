/* ple_prep.core._native: the format layer's hot loops, compiled when a compiler is there at install
 * (setup.py); ple_prep/runtime/gather.py and ple_prep/format/order.py hold the numpy fallback of
 * each, with the same results bit for bit. Both release the GIL, so work split over threads scales.
 *
 * copy_rows(mapping, slots, out, data_offset, page_size, rows_per_page, row_bytes, num_slots)
 *     out[i] = the row at file slot slots[i]: one memcpy per row, straight into `out`. A page the
 *     kernel cannot read (an I/O error, a file that shrank) raises OSError instead of a SIGBUS
 *     (guard.h).
 * slot_of(ids, first_row, num_rows, rank_words, packed_slots, out)
 *     out[i] = the file slot of row id ids[i] (local row ids[i] - first_row, refused outside
 *     [0, num_rows)), from format/order.py's rank index (rows.h; the identity where it places no row).
 *
 * page_sums(pages, page_size, out)
 *     out[k] = the low 32 bits of XXH64 of page k of `pages` (pagesums.h), for the page-sums file
 *     and the disk tier's read verification (format/pagesums.py).
 *
 * ngram_mix, run_lengths, merge_counts, head_rows
 *     The n-gram hash and the profile's counting (ngramcount.c).
 * pack_groups, take_new_rows
 *     The planner's page packing and its new rows of each group (pack.c).
 * rank_bits, slots_by_rank, pack_slots
 *     The construction of format/order.py's rank index (rankindex.c).
 *
 * The runtime's staging, thread pool and CUDA driver calls are ple_prep.runtime._native
 * (runtime/native/module.c), which builds on rows.h and buffers.h here.
 */
#include <string.h>

#include "buffers.h"
#include "guard.h"
#include "ngramcount.h"
#include "pack.h"
#include "rankindex.h"
#include "pagesums.h"
#include "rows.h"

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    PyObject *mapping_object, *slots_object, *out_object;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots;
    if (!PyArg_ParseTuple(args, "OOOnnnnn", &mapping_object, &slots_object, &out_object, &data_offset,
                          &page_size, &rows_per_page, &row_bytes, &num_slots)
        || check_geometry(data_offset, page_size, rows_per_page, row_bytes, num_slots) != 0)
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *mapping, *slots, *out;
    if (!(mapping = hold(&held, mapping_object, 0, 1, "mapping"))
        || !(slots = hold(&held, slots_object, 0, sizeof(int64_t), "slots"))
        || !(out = hold(&held, out_object, 1, 1, "out")))
        goto done;
    Py_ssize_t count = slots->len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t num_pages = (num_slots + rows_per_page - 1) / rows_per_page;
    if (out->len != count * row_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not %zd rows of %zd", out->len, count, row_bytes);
        goto done;
    }
    if (data_offset + num_pages * page_size > mapping->len) {
        PyErr_SetString(PyExc_ValueError, "the mapping is shorter than its pages");
        goto done;
    }
    const int64_t *slot = (const int64_t *)slots->buf;
    const char *data = (const char *)mapping->buf + data_offset;
    char *target = (char *)out->buf;
    /* Written through a pointer, so that its value survives a fault's jump back (guard.h). */
    volatile int64_t bad_slot = 0;
    volatile int bad = 0;
    int faulted = 0;
    fault_guard guard;
    Py_BEGIN_ALLOW_THREADS
    if (sigsetjmp(guard.jump, 0) != 0) {
        faulted = 1;
    } else {
        current_guard = &guard;
        for (Py_ssize_t i = 0; i < count; i++) {
            /* Read once: a caller writing its slots meanwhile cannot move a copy outside the table. */
            int64_t s = slot[i];
            if (i + PREFETCH_AHEAD < count) {
                int64_t ahead = slot[i + PREFETCH_AHEAD];
                if ((uint64_t)ahead < (uint64_t)num_slots)
                    prefetch_row(row_address(data, ahead, page_size, rows_per_page, row_bytes), row_bytes);
            }
            if ((uint64_t)s >= (uint64_t)num_slots) {
                bad_slot = s;
                bad = 1;
                break;
            }
            memcpy(target + i * row_bytes, row_address(data, s, page_size, rows_per_page, row_bytes),
                   (size_t)row_bytes);
        }
        current_guard = NULL;
    }
    Py_END_ALLOW_THREADS
    if (faulted) {
        refuse_fault((const char *)mapping->buf, guard.address);
        goto done;
    }
    if (bad) {
        PyErr_Format(PyExc_IndexError, "slot %lld is outside the table's %zd slots", (long long)bad_slot, num_slots);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&held);
    return result;
}

static PyObject *slot_of(PyObject *self, PyObject *args)
{
    PyObject *ids_object, *rank_words_object, *packed_slots_object, *out_object;
    long long first_row, num_rows;
    if (!PyArg_ParseTuple(args, "OLLOOO", &ids_object, &first_row, &num_rows, &rank_words_object,
                          &packed_slots_object, &out_object))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *ids, *rank_words, *packed_slots, *out;
    if (!(ids = hold(&held, ids_object, 0, sizeof(int64_t), "ids"))
        || !(rank_words = hold(&held, rank_words_object, 0, sizeof(uint64_t), "rank_words"))
        || !(packed_slots = hold(&held, packed_slots_object, 0, 1, "packed_slots"))
        || !(out = hold(&held, out_object, 1, sizeof(int64_t), "out")))
        goto done;
    int64_t num_placed = rank_index_placed(rank_words->buf, rank_words->len, packed_slots->len, num_rows);
    if (out->len != ids->len || num_rows < 0 || num_placed < 0) {
        PyErr_SetString(PyExc_ValueError, "slot_of: mismatched array sizes");
        goto done;
    }
    const int64_t *id = (const int64_t *)ids->buf;
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    find_slots(id, ids->len / (Py_ssize_t)sizeof(int64_t), first_row, num_rows, (const uint64_t *)rank_words->buf,
               (const uint8_t *)packed_slots->buf, num_placed, (int64_t *)out->buf, &bad);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        refuse_row_id(id[bad], first_row, num_rows);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&held);
    return result;
}

static PyObject *page_sums(PyObject *self, PyObject *args)
{
    PyObject *pages_object, *out_object;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "OnO", &pages_object, &page_size, &out_object))
        return NULL;
    if (page_size < 32 || page_size % 32) {
        PyErr_SetString(PyExc_ValueError, "page_sums: page_size must be a positive multiple of 32");
        return NULL;
    }
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *pages, *out;
    if (!(pages = hold(&held, pages_object, 0, 1, "pages")) || !(out = hold(&held, out_object, 1, sizeof(uint32_t), "out")))
        goto done;
    Py_ssize_t count = out->len / (Py_ssize_t)sizeof(uint32_t);
    if (pages->len != count * page_size) {
        PyErr_Format(PyExc_ValueError, "page_sums: %zd bytes are not %zd pages of %zd", pages->len, count, page_size);
        goto done;
    }
    const unsigned char *data = pages->buf;
    uint32_t *sums = out->buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++)
        sums[k] = (uint32_t)xxh64_stripes(data + k * page_size, (size_t)page_size);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&held);
    return result;
}

static PyMethodDef methods[] = {
    {"page_sums", page_sums, METH_VARARGS, "The low 32 bits of XXH64 of each page (see the module's comment)."},
    {"copy_rows", copy_rows, METH_VARARGS, "Rows at file slots into out (see the module's comment)."},
    {"slot_of", slot_of, METH_VARARGS, "File slots of row ids from the rank index."},
    NGRAMCOUNT_METHODS
    PACK_METHODS
    RANKINDEX_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    select_find_slots();
    if (guard_faults() != 0)
        return NULL;
    return PyModule_Create(&module);
}
