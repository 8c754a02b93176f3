/* The host lookup's two hot loops, compiled when a compiler is there at install (setup.py);
 * ple_prep/runtime/gather.py and ple_prep/format/order.py hold the numpy fallback of each, with
 * the same results bit for bit. Both release the GIL, so a gather split over threads scales.
 *
 * copy_rows(mapping, slots, out, data_offset, page_size, rows_per_page, row_bytes, num_slots)
 *     out[i] = the row at file slot slots[i]: one memcpy per row, straight into `out`.
 * slot_of(rows, bits, below, sorted_slots, out)
 *     out[i] = the file slot of local row rows[i], from format/order.py's rank index.
 * cached(mapping, slots, data_offset, page_size, rows_per_page, row_bytes, num_slots, probes)
 *     Whether the memory page holding the first byte of each of `probes` rows spread over the
 *     request (first and last included) is in the page cache (mincore); slots outside the table are
 *     left to copy_rows to refuse.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Ids looked at ahead of the one being resolved: enough misses in flight to cover memory latency. */
#define PREFETCH_AHEAD 16

static int get_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t item, const char *name)
{
    if (PyObject_GetBuffer(object, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) != 0)
        return -1;
    if (view->len % item != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items",
                     name, view->len, item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    PyObject *mapping_object, *slots_object, *out_object;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots;
    if (!PyArg_ParseTuple(args, "OOOnnnnn", &mapping_object, &slots_object, &out_object, &data_offset,
                          &page_size, &rows_per_page, &row_bytes, &num_slots))
        return NULL;
    if (row_bytes <= 0 || rows_per_page <= 0 || rows_per_page * row_bytes > page_size || data_offset < 0
        || num_slots < 0) {
        PyErr_SetString(PyExc_ValueError, "bad table geometry");
        return NULL;
    }
    Py_buffer mapping, slots, out;
    if (get_buffer(mapping_object, &mapping, 0, 1, "mapping") != 0)
        return NULL;
    if (get_buffer(slots_object, &slots, 0, sizeof(int64_t), "slots") != 0) {
        PyBuffer_Release(&mapping);
        return NULL;
    }
    if (get_buffer(out_object, &out, 1, 1, "out") != 0) {
        PyBuffer_Release(&slots);
        PyBuffer_Release(&mapping);
        return NULL;
    }
    Py_ssize_t count = slots.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t num_pages = (num_slots + rows_per_page - 1) / rows_per_page;
    PyObject *result = Py_None;
    if (out.len != count * row_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not %zd rows of %zd", out.len, count, row_bytes);
        result = NULL;
    } else if (data_offset + num_pages * page_size > mapping.len) {
        PyErr_SetString(PyExc_ValueError, "the mapping is shorter than its pages");
        result = NULL;
    } else {
        const int64_t *slot = (const int64_t *)slots.buf;
        const char *base = (const char *)mapping.buf + data_offset;
        char *target = (char *)out.buf;
        Py_ssize_t bad = -1;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
            if (i + PREFETCH_AHEAD < count && (uint64_t)slot[i + PREFETCH_AHEAD] < (uint64_t)num_slots) {
                int64_t ahead = slot[i + PREFETCH_AHEAD];
                const char *row = base + (ahead / rows_per_page) * page_size + (ahead % rows_per_page) * row_bytes;
                for (Py_ssize_t line = 0; line < row_bytes; line += 64)
                    __builtin_prefetch(row + line);
                __builtin_prefetch(row + row_bytes - 1);
            }
            int64_t s = slot[i];
            if ((uint64_t)s >= (uint64_t)num_slots) {
                bad = i;
                break;
            }
            memcpy(target + i * row_bytes, base + (s / rows_per_page) * page_size + (s % rows_per_page) * row_bytes,
                   (size_t)row_bytes);
        }
        Py_END_ALLOW_THREADS
        if (bad >= 0) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the table's %zd slots",
                         (long long)slot[bad], num_slots);
            result = NULL;
        }
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&mapping);
    if (result)
        Py_INCREF(result);
    return result;
}

static PyObject *slot_of(PyObject *self, PyObject *args)
{
    PyObject *rows_object, *bits_object, *below_object, *sorted_slots_object, *out_object;
    if (!PyArg_ParseTuple(args, "OOOOO", &rows_object, &bits_object, &below_object, &sorted_slots_object,
                          &out_object))
        return NULL;
    Py_buffer rows, bits, below, sorted_slots, out;
    Py_buffer *held[5];
    int num_held = 0;
    PyObject *result = NULL;
    if (get_buffer(rows_object, &rows, 0, sizeof(int64_t), "rows") != 0)
        goto done;
    held[num_held++] = &rows;
    if (get_buffer(bits_object, &bits, 0, sizeof(uint64_t), "bits") != 0)
        goto done;
    held[num_held++] = &bits;
    if (get_buffer(below_object, &below, 0, sizeof(uint32_t), "below") != 0)
        goto done;
    held[num_held++] = &below;
    if (get_buffer(sorted_slots_object, &sorted_slots, 0, sizeof(uint32_t), "sorted_slots") != 0)
        goto done;
    held[num_held++] = &sorted_slots;
    if (get_buffer(out_object, &out, 1, sizeof(int64_t), "out") != 0)
        goto done;
    held[num_held++] = &out;
    Py_ssize_t count = rows.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t num_words = bits.len / (Py_ssize_t)sizeof(uint64_t);
    int64_t num_placed = sorted_slots.len / (Py_ssize_t)sizeof(uint32_t);
    if (out.len != rows.len || below.len / (Py_ssize_t)sizeof(uint32_t) != num_words) {
        PyErr_SetString(PyExc_ValueError, "slot_of: mismatched array sizes");
        goto done;
    }
    const int64_t *row = (const int64_t *)rows.buf;
    const uint64_t *word = (const uint64_t *)bits.buf;
    const uint32_t *before = (const uint32_t *)below.buf;
    const uint32_t *slot = (const uint32_t *)sorted_slots.buf;
    int64_t *target = (int64_t *)out.buf;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    /* Two passes, each prefetching PREFETCH_AHEAD ids ahead, so the cache misses of many ids
     * overlap: first each row's rank (placed rows below it, negated for a placed row), then the
     * placed rows' slots. */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_AHEAD < count) {
            uint64_t ahead = (uint64_t)row[i + PREFETCH_AHEAD] >> 6;
            if (ahead < (uint64_t)num_words) {
                __builtin_prefetch(&word[ahead]);
                __builtin_prefetch(&before[ahead]);
            }
        }
        int64_t r = row[i];
        if (r < 0 || (r >> 6) >= num_words) {
            bad = i;
            break;
        }
        /* The row's bit moved to the top: it says whether the row is placed, and the bits at and
         * below it count the placed rows up to it. */
        uint64_t bits_to_row = word[r >> 6] << (63 - (r & 63));
        int64_t placed = (int64_t)(bits_to_row >> 63);
        int64_t position = (int64_t)before[r >> 6] + __builtin_popcountll(bits_to_row) - placed;
        if (placed && position >= num_placed) {
            bad = i;
            break;
        }
        target[i] = placed ? -1 - position : num_placed + r - position;
    }
    if (bad < 0) {
        for (Py_ssize_t i = 0; i < count; i++) {
            if (i + PREFETCH_AHEAD < count && target[i + PREFETCH_AHEAD] < 0)
                __builtin_prefetch(&slot[-1 - target[i + PREFETCH_AHEAD]]);
            if (target[i] < 0)
                target[i] = slot[-1 - target[i]];
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "row %lld is outside the rank index", (long long)row[bad]);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    while (num_held)
        PyBuffer_Release(held[--num_held]);
    return result;
}

static PyObject *cached(PyObject *self, PyObject *args)
{
    PyObject *mapping_object, *slots_object;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots, probes;
    if (!PyArg_ParseTuple(args, "OOnnnnnn", &mapping_object, &slots_object, &data_offset, &page_size,
                          &rows_per_page, &row_bytes, &num_slots, &probes))
        return NULL;
    if (row_bytes <= 0 || rows_per_page <= 0 || rows_per_page * row_bytes > page_size || data_offset < 0
        || num_slots < 0 || probes < 2) {
        PyErr_SetString(PyExc_ValueError, "bad table geometry");
        return NULL;
    }
    Py_buffer mapping, slots;
    if (get_buffer(mapping_object, &mapping, 0, 1, "mapping") != 0)
        return NULL;
    if (get_buffer(slots_object, &slots, 0, sizeof(int64_t), "slots") != 0) {
        PyBuffer_Release(&mapping);
        return NULL;
    }
    Py_ssize_t count = slots.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *slot = (const int64_t *)slots.buf;
    uintptr_t system_page = (uintptr_t)sysconf(_SC_PAGESIZE);
    int resident = 1;
    for (Py_ssize_t k = 0; k < probes && count && resident; k++) {
        int64_t s = slot[(count - 1) * k / (probes - 1)];
        Py_ssize_t offset = data_offset + (s / rows_per_page) * page_size + (s % rows_per_page) * row_bytes;
        if ((uint64_t)s >= (uint64_t)num_slots || offset >= mapping.len)
            continue;
        uintptr_t address = (uintptr_t)mapping.buf + (uintptr_t)offset;
        unsigned char state = 0;
        resident = mincore((void *)(address - address % system_page), 1, &state) == 0 && (state & 1);
    }
    PyBuffer_Release(&slots);
    PyBuffer_Release(&mapping);
    return PyBool_FromLong(resident);
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS, "Rows at file slots into out (see the module's comment)."},
    {"slot_of", slot_of, METH_VARARGS, "File slots of local rows from the rank index."},
    {"cached", cached, METH_VARARGS, "Whether a few rows spread over a request are in the page cache."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
