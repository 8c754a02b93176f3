/* The rank index of format/order.py built from a map's `slot_rows` (uint32, the placed rows in slot
 * order): one loop a pass where numpy takes a dozen, as opening the model's table (tens of millions
 * of placed rows) and planning one do (docs/benchmark-history.md, "What moved the convert,
 * 2026-12-03").
 *
 * rank_bits(slot_rows, num_rows, rank_words) -> placed rows counted, or the first row >= num_rows
 *     rank_words (words, 2) uint64: column 0 each 64 rows' bits (placed or not), column 1 the
 *     placed rows before them. A row placed twice sets one bit: the count returned is then below
 *     len(slot_rows), which the caller refuses. A row outside the table is returned as -1 - row.
 * slots_by_rank(slot_rows, rank_words, out, divisor, item)
 *     out[rank of slot_rows[s]] = s / divisor, `out` of `item`-byte unsigned integers (1, 2, 4):
 *     each placed row's slot in row order (divisor 1), or its write chunk's number
 *     (offline/ordered.py).
 *     It refuses (ValueError) a row the bits do not hold, so no write lands outside `out`.
 * pack_slots(area, count)
 *     The `count` uint32 slots at the start of `area` packed there, in place, in slot_bits(count)
 *     bits each, little-endian (the index's packed slots, rows.h): packed_slots_bytes(count) bytes,
 *     every one of them written.
 */
#include "rankindex.h"

#include "buffers.h"
#include "rows.h"

/* Placed rows below `row`, whose 64 rows' pair is `pair`; -1 where `row` is not placed. */
static inline int64_t rank_of(const uint64_t *pair, uint32_t row)
{
    uint64_t bit = (uint64_t)1 << (row & 63);
    if (!(pair[0] & bit))
        return -1;
    return (int64_t)pair[1] + __builtin_popcountll(pair[0] & (bit - 1));
}

PyObject *rank_bits(PyObject *self, PyObject *args)
{
    PyObject *slot_rows_object, *rank_words_object;
    long long num_rows;
    if (!PyArg_ParseTuple(args, "OLO", &slot_rows_object, &num_rows, &rank_words_object))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *slot_rows, *rank_words;
    if (!(slot_rows = hold(&held, slot_rows_object, 0, sizeof(uint32_t), "slot_rows"))
        || !(rank_words = hold(&held, rank_words_object, 1, sizeof(uint64_t), "rank_words")))
        goto done;
    Py_ssize_t words = rank_words->len / (Py_ssize_t)(2 * sizeof(uint64_t));
    if (num_rows < 0 || rank_words->len % (Py_ssize_t)(2 * sizeof(uint64_t)) || words != (num_rows + 63) / 64) {
        PyErr_SetString(PyExc_ValueError, "rank_bits: rank_words is not (ceil(num_rows / 64), 2)");
        goto done;
    }
    const uint32_t *row = slot_rows->buf;
    Py_ssize_t count = slot_rows->len / (Py_ssize_t)sizeof(uint32_t);
    uint64_t *pair = rank_words->buf;
    long long outside = -1, placed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t w = 0; w < words; w++)
        pair[2 * w] = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + RANK_PREFETCH_AHEAD < count && row[i + RANK_PREFETCH_AHEAD] < num_rows)
            __builtin_prefetch(&pair[2 * (row[i + RANK_PREFETCH_AHEAD] >> 6)], 1);
        if (row[i] >= num_rows) {
            outside = row[i];
            break;
        }
        pair[2 * (row[i] >> 6)] |= (uint64_t)1 << (row[i] & 63);
    }
    if (outside < 0)
        for (Py_ssize_t w = 0; w < words; w++) {
            pair[2 * w + 1] = (uint64_t)placed;
            placed += __builtin_popcountll(pair[2 * w]);
        }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(outside < 0 ? placed : -1 - outside);
done:
    release(&held);
    return result;
}

PyObject *slots_by_rank(PyObject *self, PyObject *args)
{
    PyObject *rows_object, *rank_words_object, *out_object;
    long long divisor;
    Py_ssize_t item;
    if (!PyArg_ParseTuple(args, "OOOLn", &rows_object, &rank_words_object, &out_object, &divisor, &item))
        return NULL;
    if (divisor < 1 || (item != 1 && item != 2 && item != 4)) {
        PyErr_SetString(PyExc_ValueError, "slots_by_rank: divisor < 1, or out not of 1, 2 or 4-byte items");
        return NULL;
    }
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *rows, *rank_words, *out;
    if (!(rows = hold(&held, rows_object, 0, sizeof(uint32_t), "slot_rows"))
        || !(rank_words = hold(&held, rank_words_object, 0, sizeof(uint64_t), "rank_words"))
        || !(out = hold(&held, out_object, 1, item, "out")))
        goto done;
    Py_ssize_t count = rows->len / (Py_ssize_t)sizeof(uint32_t);
    if (rank_words->len % (Py_ssize_t)(2 * sizeof(uint64_t)) || out->len != count * item
        || (count - 1) / divisor > (item == 4 ? (long long)UINT32_MAX : (1LL << (8 * item)) - 1)) {
        PyErr_SetString(PyExc_ValueError, "slots_by_rank: mismatched array sizes, or values too large for out");
        goto done;
    }
    const uint32_t *row = rows->buf;
    const uint64_t *pair = rank_words->buf;
    uint64_t words = (uint64_t)(rank_words->len / (Py_ssize_t)(2 * sizeof(uint64_t)));
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < count; s++) {
        if (s + RANK_PREFETCH_AHEAD < count && (row[s + RANK_PREFETCH_AHEAD] >> 6) < words)
            __builtin_prefetch(&pair[2 * (row[s + RANK_PREFETCH_AHEAD] >> 6)]);
        int64_t rank = (row[s] >> 6) < words ? rank_of(&pair[2 * (row[s] >> 6)], row[s]) : -1;
        if (rank < 0 || rank >= count) {
            bad = s;
            break;
        }
        uint64_t value = (uint64_t)s / (uint64_t)divisor;
        if (item == 4)
            ((uint32_t *)out->buf)[rank] = (uint32_t)value;
        else if (item == 2)
            ((uint16_t *)out->buf)[rank] = (uint16_t)value;
        else
            ((uint8_t *)out->buf)[rank] = (uint8_t)value;
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

PyObject *pack_slots(PyObject *self, PyObject *args)
{
    PyObject *area_object;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "On", &area_object, &count))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *area;
    if (!(area = hold(&held, area_object, 1, 1, "area")))
        goto done;
    if (count < 1 || area->len < 4 * count || area->len < packed_slots_bytes(count)) {
        PyErr_SetString(PyExc_ValueError, "pack_slots: no slots, or an area shorter than the slots or their packing");
        goto done;
    }
    /* In place: word k, written once value 2k + 1 (the last that word's bytes held) has been read,
     * since a value takes at most 32 bits. memcpy, not pointers of two types, so that the compiler
     * keeps every read before the write that follows it. */
    char *bytes = area->buf;
    const int bits = slot_bits(count);
    uint64_t mask = ((uint64_t)1 << bits) - 1, pending = 0;
    int filled = 0;
    Py_ssize_t written = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t read;
        memcpy(&read, bytes + 4 * i, sizeof read);
        uint64_t value = read & mask;
        pending |= value << filled;
        filled += bits;
        if (filled >= 64) {
            memcpy(bytes + 8 * written++, &pending, sizeof pending);
            filled -= 64;
            pending = filled ? value >> (bits - filled) : 0;
        }
    }
    if (filled)
        memcpy(bytes + 8 * written++, &pending, sizeof pending);
    memset(bytes + 8 * written, 0, (size_t)(packed_slots_bytes(count) - 8 * written));
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&held);
    return result;
}
