/* The rank index of format/order.py built from a map's `slot_rows` (uint32, the placed rows in slot
 * order): one loop a pass where numpy takes a dozen, as opening the model's table (tens of millions
 * of placed rows) and planning one do (docs/benchmark-history.md, "What moved the convert,
 * 2026-12-03").
 *
 * rank_bits(slot_rows, num_rows, rank_lines) -> placed rows counted, or the first row >= num_rows
 *     rank_lines (lines, 8) uint64 (rows.h, rank_index): each RANK_LINE_ROWS rows' line, the placed
 *     rows before them, then their bits (placed or not). A row placed twice sets one bit: the count
 *     returned is then below len(slot_rows), which the caller refuses. A row outside the table is
 *     returned as -1 - row.
 * slots_by_rank(slot_rows, rank_lines, out, divisor, width)
 *     value number (rank of slot_rows[s]) of `out` = s / divisor, values of `width` bits (1 to 32)
 *     packed in little-endian bit order (a uint8, uint16 or uint32 array at 8, 16 or 32 bits; the
 *     index's packed slots, divisor 1, at any width): each placed row's slot in row order, or its
 *     write chunk's number (offline/ordered.py). Every value's bits are written, the others' kept.
 * It refuses (ValueError) a row the bits do not hold, so no write lands outside `out`.
 */
#include "rankindex.h"

#include "buffers.h"
#include "rows.h"

/* Placed rows below local row `row` of `lines` (rows.h); -1 where `row` is not placed. */
static inline int64_t rank_of(const uint64_t *lines, uint32_t row)
{
    const uint64_t *line = &lines[RANK_LINE_WORDS * (row / RANK_LINE_ROWS)];
    uint32_t within = row % RANK_LINE_ROWS, word = within >> 6;
    uint64_t bit = (uint64_t)1 << (within & 63);
    if (!(line[1 + word] & bit))
        return -1;
    int64_t rank = (int64_t)line[0] + __builtin_popcountll(line[1 + word] & (bit - 1));
    for (uint32_t k = 0; k < word; k++)
        rank += __builtin_popcountll(line[1 + k]);
    return rank;
}

/* Writes `value` as value number `index` of `width` bits in `bytes`, the bits around it kept. */
static inline void store_packed(unsigned char *bytes, uint64_t index, int width, uint64_t value)
{
    uint64_t bit = index * (uint64_t)width;
    unsigned shift = bit & 7;
    uint64_t mask = (((uint64_t)1 << width) - 1) << shift;
    value <<= shift;
    unsigned char *at = bytes + (bit >> 3);
    for (unsigned b = 0; 8 * b < shift + (unsigned)width; b++) {
        unsigned char keep = (unsigned char)~(mask >> (8 * b));
        at[b] = (unsigned char)((at[b] & keep) | ((value >> (8 * b)) & ~keep));
    }
}

PyObject *rank_bits(PyObject *self, PyObject *args)
{
    PyObject *slot_rows_object, *rank_lines_object;
    long long num_rows;
    if (!PyArg_ParseTuple(args, "OLO", &slot_rows_object, &num_rows, &rank_lines_object))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *slot_rows, *rank_lines;
    if (!(slot_rows = hold(&held, slot_rows_object, 0, sizeof(uint32_t), "slot_rows"))
        || !(rank_lines = hold(&held, rank_lines_object, 1, sizeof(uint64_t), "rank_lines")))
        goto done;
    Py_ssize_t line_bytes = RANK_LINE_WORDS * (Py_ssize_t)sizeof(uint64_t);
    Py_ssize_t lines = rank_lines->len / line_bytes;
    if (num_rows < 0 || rank_lines->len % line_bytes || lines != (num_rows + RANK_LINE_ROWS - 1) / RANK_LINE_ROWS) {
        PyErr_SetString(PyExc_ValueError, "rank_bits: rank_lines is not (ceil(num_rows / 448), 8)");
        goto done;
    }
    const uint32_t *row = slot_rows->buf;
    Py_ssize_t count = slot_rows->len / (Py_ssize_t)sizeof(uint32_t);
    uint64_t *line = rank_lines->buf;
    long long outside = -1, placed = 0;
    Py_BEGIN_ALLOW_THREADS
    memset(line, 0, (size_t)rank_lines->len);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + RANK_PREFETCH_AHEAD < count && row[i + RANK_PREFETCH_AHEAD] < num_rows)
            __builtin_prefetch(&line[RANK_LINE_WORDS * (row[i + RANK_PREFETCH_AHEAD] / RANK_LINE_ROWS)], 1);
        if (row[i] >= num_rows) {
            outside = row[i];
            break;
        }
        uint32_t within = row[i] % RANK_LINE_ROWS;
        line[RANK_LINE_WORDS * (row[i] / RANK_LINE_ROWS) + 1 + (within >> 6)] |= (uint64_t)1 << (within & 63);
    }
    if (outside < 0)
        for (Py_ssize_t l = 0; l < lines; l++) {
            line[RANK_LINE_WORDS * l] = (uint64_t)placed;
            for (int k = 1; k < RANK_LINE_WORDS; k++)
                placed += __builtin_popcountll(line[RANK_LINE_WORDS * l + k]);
        }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(outside < 0 ? placed : -1 - outside);
done:
    release(&held);
    return result;
}

PyObject *slots_by_rank(PyObject *self, PyObject *args)
{
    PyObject *rows_object, *rank_lines_object, *out_object;
    long long divisor;
    int width;
    if (!PyArg_ParseTuple(args, "OOOLi", &rows_object, &rank_lines_object, &out_object, &divisor, &width))
        return NULL;
    if (divisor < 1 || width < 1 || width > 32) {
        PyErr_SetString(PyExc_ValueError, "slots_by_rank: divisor < 1, or a width outside 1 to 32 bits");
        return NULL;
    }
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *rows, *rank_lines, *out;
    if (!(rows = hold(&held, rows_object, 0, sizeof(uint32_t), "slot_rows"))
        || !(rank_lines = hold(&held, rank_lines_object, 0, sizeof(uint64_t), "rank_lines"))
        || !(out = hold(&held, out_object, 1, 1, "out")))
        goto done;
    Py_ssize_t count = rows->len / (Py_ssize_t)sizeof(uint32_t);
    Py_ssize_t line_bytes = RANK_LINE_WORDS * (Py_ssize_t)sizeof(uint64_t);
    if (rank_lines->len % line_bytes || out->len < (count * (Py_ssize_t)width + 7) / 8
        || (count > 1 && (uint64_t)((count - 1) / divisor) >> width)) {
        PyErr_SetString(PyExc_ValueError, "slots_by_rank: mismatched array sizes, or values too large for out");
        goto done;
    }
    const uint32_t *row = rows->buf;
    const uint64_t *lines = rank_lines->buf;
    uint64_t num_lines = (uint64_t)(rank_lines->len / line_bytes);
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < count; s++) {
        if (s + RANK_PREFETCH_AHEAD < count && row[s + RANK_PREFETCH_AHEAD] / RANK_LINE_ROWS < num_lines)
            __builtin_prefetch(&lines[RANK_LINE_WORDS * (row[s + RANK_PREFETCH_AHEAD] / RANK_LINE_ROWS)]);
        int64_t rank = row[s] / RANK_LINE_ROWS < num_lines ? rank_of(lines, row[s]) : -1;
        if (rank < 0 || rank >= count) {
            bad = s;
            break;
        }
        store_packed(out->buf, (uint64_t)rank, width, (uint64_t)s / (uint64_t)divisor);
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "slots_by_rank: row %u of slot %zd is not placed", row[bad], bad);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&held);
    return result;
}
