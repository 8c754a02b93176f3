/* The n-gram hash and the profile's counting loops (ngramcount.h). Each releases the GIL.
 *
 * ngram_mix(tokens, previous, starts, multipliers, eos, out)
 *     out[(n - 2) * count + i] = the mixed hash of the order-n n-gram ending at tokens[i]
 *     (ple_prep/ngram.py `mixed_columns`, docs/MODEL.md): tokens int64 (count); previous int64
 *     (ngram_size - 1), the tokens before tokens[0], oldest first, EOS where there are none; starts
 *     int64, sorted positions where a new request begins (what lies before one reads EOS);
 *     multipliers uint64 (ngram_size).
 * run_lengths(values, keys, counts) -> n
 *     The n distinct values of a sorted uint64 array into keys[:n] (which may be `values` itself)
 *     and how often each occurs into counts[:n].
 * merge_counts(keys_a, counts_a, keys_b, counts_b, keys, counts) -> n
 *     Two runs of sorted distinct uint64 keys with uint64 counts merged into keys[:n], counts[:n],
 *     the counts of a key in both summed (modulo 2**64, as numpy's uint64 sums).
 * head_rows(keys, counts, size, offset, dense, rows, row_counts) -> n
 *     The rows one hash head reads for counted groups (row = key % size + offset), sorted and
 *     distinct into rows[:n] (int64), each with the sum of its groups' counts. `dense` counts into
 *     an array of `size` and lists the rows whose sum is not 0; otherwise rows are sorted and every
 *     row read is listed (ple_prep/offline/profile.py `_sum_in_range` chooses the same way).
 */
#include <stdlib.h>
#include <string.h>

#include "buffers.h"
#include "ngramcount.h"

#define RADIX_BITS 11
#define RADIX_SIZE (1 << RADIX_BITS)

static void mix(const int64_t *tokens, Py_ssize_t count, const int64_t *previous, Py_ssize_t history,
                const int64_t *starts, Py_ssize_t num_starts, const uint64_t *multipliers, uint64_t eos,
                uint64_t *out)
{
    Py_ssize_t next = 0, start = PY_SSIZE_T_MIN;
    for (Py_ssize_t i = 0; i < count; i++) {
        while (next < num_starts && starts[next] <= i)
            start = starts[next++];
        uint64_t running = (uint64_t)tokens[i] * multipliers[0];
        int cut = 0;
        for (Py_ssize_t step = 1; step <= history; step++) {
            Py_ssize_t at = i - step;
            /* Once EOS is read (or the request's start passed), every older position reads EOS. */
            uint64_t value = cut || at < start ? eos : at >= 0 ? (uint64_t)tokens[at] : (uint64_t)previous[history + at];
            cut |= value == eos;
            running ^= value * multipliers[step];
            out[(step - 1) * count + i] = running;
        }
    }
}

PyObject *ngram_mix(PyObject *self, PyObject *args)
{
    PyObject *tokens_object, *previous_object, *starts_object, *multipliers_object, *out_object;
    unsigned long long eos;
    if (!PyArg_ParseTuple(args, "OOOOKO", &tokens_object, &previous_object, &starts_object, &multipliers_object,
                          &eos, &out_object))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *tokens, *previous, *starts, *multipliers, *out;
    if (!(tokens = hold(&held, tokens_object, 0, sizeof(int64_t), "tokens"))
        || !(previous = hold(&held, previous_object, 0, sizeof(int64_t), "previous"))
        || !(starts = hold(&held, starts_object, 0, sizeof(int64_t), "starts"))
        || !(multipliers = hold(&held, multipliers_object, 0, sizeof(uint64_t), "multipliers"))
        || !(out = hold(&held, out_object, 1, sizeof(uint64_t), "out")))
        goto done;
    Py_ssize_t count = tokens->len / 8, history = previous->len / 8, num_starts = starts->len / 8;
    if (history < 1 || multipliers->len / 8 != history + 1 || out->len / 8 != history * count) {
        PyErr_SetString(PyExc_ValueError, "ngram_mix: previous, multipliers and out disagree on the n-gram size");
        goto done;
    }
    const int64_t *start = starts->buf;
    for (Py_ssize_t k = 0; k < num_starts; k++) {
        if (start[k] < 0 || (k && start[k] < start[k - 1])) {
            PyErr_SetString(PyExc_ValueError, "ngram_mix: request starts must be sorted and not negative");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    mix(tokens->buf, count, previous->buf, history, start, num_starts, multipliers->buf, (uint64_t)eos, out->buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&held);
    return result;
}

PyObject *run_lengths(PyObject *self, PyObject *args)
{
    PyObject *values_object, *keys_object, *counts_object;
    if (!PyArg_ParseTuple(args, "OOO", &values_object, &keys_object, &counts_object))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *values, *keys, *counts;
    if (!(values = hold(&held, values_object, 0, sizeof(uint64_t), "values"))
        || !(keys = hold(&held, keys_object, 1, sizeof(uint64_t), "keys"))
        || !(counts = hold(&held, counts_object, 1, sizeof(uint64_t), "counts")))
        goto done;
    Py_ssize_t count = values->len / 8, distinct = 0;
    if (keys->len < values->len || counts->len < values->len) {
        PyErr_SetString(PyExc_ValueError, "run_lengths: keys and counts must hold as many items as values");
        goto done;
    }
    const uint64_t *value = values->buf;
    uint64_t *key = keys->buf, *number = counts->buf;
    Py_BEGIN_ALLOW_THREADS
    /* keys[distinct] is written after values[distinct] was read: keys may be values. */
    for (Py_ssize_t i = 0; i < count;) {
        uint64_t current = value[i];
        Py_ssize_t first = i;
        while (++i < count && value[i] == current)
            ;
        key[distinct] = current;
        number[distinct++] = (uint64_t)(i - first);
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(distinct);
done:
    release(&held);
    return result;
}

static int overlaps(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len && b->len && a0 < b0 + b->len && b0 < a0 + a->len;
}

PyObject *merge_counts(PyObject *self, PyObject *args)
{
    PyObject *objects[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4],
                          &objects[5]))
        return NULL;
    static const char *names[6] = {"keys_a", "counts_a", "keys_b", "counts_b", "keys", "counts"};
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *view[6];
    for (int k = 0; k < 6; k++)
        if (!(view[k] = hold(&held, objects[k], k >= 4, sizeof(uint64_t), names[k])))
            goto done;
    Py_ssize_t na = view[0]->len / 8, nb = view[2]->len / 8;
    if (view[1]->len != view[0]->len || view[3]->len != view[2]->len || view[4]->len / 8 < na + nb
        || view[5]->len / 8 < na + nb) {
        PyErr_SetString(PyExc_ValueError, "merge_counts: each run needs a count per key, and the output room for both");
        goto done;
    }
    for (int k = 0; k < 5; k++)
        if (overlaps(view[k], view[5]) || (k < 4 && overlaps(view[k], view[4]))) {
            PyErr_SetString(PyExc_ValueError, "merge_counts: the outputs must not overlap the runs or each other");
            goto done;
        }
    const uint64_t *ka = view[0]->buf, *ca = view[1]->buf, *kb = view[2]->buf, *cb = view[3]->buf;
    uint64_t *key = view[4]->buf, *number = view[5]->buf;
    Py_ssize_t a = 0, b = 0, n = 0;
    Py_BEGIN_ALLOW_THREADS
    while (a < na && b < nb) {
        uint64_t x = ka[a], y = kb[b];
        if (x < y) {
            key[n] = x;
            number[n++] = ca[a++];
        } else if (y < x) {
            key[n] = y;
            number[n++] = cb[b++];
        } else {
            key[n] = x;
            number[n++] = ca[a++] + cb[b++];
        }
    }
    memcpy(key + n, ka + a, (size_t)(na - a) * 8);
    memcpy(number + n, ca + a, (size_t)(na - a) * 8);
    n += na - a;
    memcpy(key + n, kb + b, (size_t)(nb - b) * 8);
    memcpy(number + n, cb + b, (size_t)(nb - b) * 8);
    n += nb - b;
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(n);
done:
    release(&held);
    return result;
}

/* a % d without a division: Lemire, Kaser and Kurz, "Faster remainder by direct computation"
 * (2019), exact for 64-bit a and d with a 128-bit M. */
#ifdef __SIZEOF_INT128__
typedef struct {
    unsigned __int128 m;
    uint64_t d;
} divisor;

static divisor divisor_of(uint64_t d)
{
    divisor out = {~(unsigned __int128)0 / d + 1, d};
    return out;
}

static inline uint64_t remainder_of(uint64_t a, divisor by)
{
    unsigned __int128 low = by.m * a;
    unsigned __int128 bottom = ((low & UINT64_MAX) * (unsigned __int128)by.d) >> 64;
    return (uint64_t)((bottom + (low >> 64) * by.d) >> 64);
}
#else
typedef struct {
    uint64_t d;
} divisor;

static divisor divisor_of(uint64_t d)
{
    divisor out = {d};
    return out;
}

static inline uint64_t remainder_of(uint64_t a, divisor by)
{
    return a % by.d;
}
#endif

/* Sorts (residue, count) pairs by residue (< 2**bits), stably, in 11-bit passes; the result is in
 * the pair of arrays the function returns through `residues` and `counts`. */
static void radix_pairs(uint32_t **residues, uint64_t **counts, uint32_t *spare_residues, uint64_t *spare_counts,
                        Py_ssize_t n, int bits, Py_ssize_t *histogram)
{
    uint32_t *from_r = *residues, *to_r = spare_residues;
    uint64_t *from_c = *counts, *to_c = spare_counts;
    for (int shift = 0; shift < bits; shift += RADIX_BITS) {
        memset(histogram, 0, RADIX_SIZE * sizeof(Py_ssize_t));
        for (Py_ssize_t i = 0; i < n; i++)
            histogram[(from_r[i] >> shift) & (RADIX_SIZE - 1)]++;
        Py_ssize_t total = 0;
        for (int digit = 0; digit < RADIX_SIZE; digit++) {
            Py_ssize_t here = histogram[digit];
            histogram[digit] = total;
            total += here;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t at = histogram[(from_r[i] >> shift) & (RADIX_SIZE - 1)]++;
            to_r[at] = from_r[i];
            to_c[at] = from_c[i];
        }
        uint32_t *swap_r = from_r;
        uint64_t *swap_c = from_c;
        from_r = to_r, from_c = to_c, to_r = swap_r, to_c = swap_c;
    }
    *residues = from_r;
    *counts = from_c;
}

/* 0, or -1 when memory ran out. */
static int rows_of_head(const uint64_t *keys, const uint64_t *counts, Py_ssize_t n, uint64_t size, int64_t offset,
                        int dense, int64_t *rows, uint64_t *row_counts, Py_ssize_t *found)
{
    divisor by = divisor_of(size);
    Py_ssize_t m = 0;
    if (dense) {
        uint64_t *sums = calloc((size_t)size, sizeof(uint64_t));
        if (!sums)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++)
            sums[remainder_of(keys[i], by)] += counts[i];
        for (uint64_t r = 0; r < size; r++)
            if (sums[r]) {
                rows[m] = (int64_t)r + offset;
                row_counts[m++] = sums[r];
            }
        free(sums);
        *found = m;
        return 0;
    }
    uint32_t *residues = malloc((size_t)n * 2 * sizeof(uint32_t) + 1);
    uint64_t *sorted_counts = malloc((size_t)n * 2 * sizeof(uint64_t) + 1);
    Py_ssize_t *histogram = malloc(RADIX_SIZE * sizeof(Py_ssize_t));
    if (!residues || !sorted_counts || !histogram) {
        free(residues), free(sorted_counts), free(histogram);
        return -1;
    }
    uint32_t *r = residues;
    uint64_t *c = sorted_counts;
    for (Py_ssize_t i = 0; i < n; i++) {
        r[i] = (uint32_t)remainder_of(keys[i], by);
        c[i] = counts[i];
    }
    int bits = 0;
    while (bits < 64 && (size - 1) >> bits)
        bits++;
    radix_pairs(&r, &c, residues + n, sorted_counts + n, n, bits, histogram);
    for (Py_ssize_t i = 0; i < n;) {
        uint32_t current = r[i];
        uint64_t sum = 0;
        for (; i < n && r[i] == current; i++)
            sum += c[i];
        rows[m] = (int64_t)current + offset;
        row_counts[m++] = sum;
    }
    free(residues), free(sorted_counts), free(histogram);
    *found = m;
    return 0;
}

PyObject *head_rows(PyObject *self, PyObject *args)
{
    PyObject *keys_object, *counts_object, *rows_object, *row_counts_object;
    unsigned long long size;
    long long offset;
    int dense;
    if (!PyArg_ParseTuple(args, "OOKLpOO", &keys_object, &counts_object, &size, &offset, &dense, &rows_object,
                          &row_counts_object))
        return NULL;
    if (size < 1 || size > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "head_rows: a head holds 1 to 2**32 - 1 rows");
        return NULL;
    }
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *keys, *counts, *rows, *row_counts;
    if (!(keys = hold(&held, keys_object, 0, sizeof(uint64_t), "keys"))
        || !(counts = hold(&held, counts_object, 0, sizeof(uint64_t), "counts"))
        || !(rows = hold(&held, rows_object, 1, sizeof(int64_t), "rows"))
        || !(row_counts = hold(&held, row_counts_object, 1, sizeof(uint64_t), "row_counts")))
        goto done;
    if (counts->len != keys->len || rows->len < keys->len || row_counts->len < keys->len) {
        PyErr_SetString(PyExc_ValueError, "head_rows: counts, rows and row_counts must hold as many items as keys");
        goto done;
    }
    Py_ssize_t found = 0;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = rows_of_head(keys->buf, counts->buf, keys->len / 8, (uint64_t)size, (int64_t)offset, dense, rows->buf,
                          row_counts->buf, &found);
    Py_END_ALLOW_THREADS
    result = failed ? PyErr_NoMemory() : PyLong_FromSsize_t(found);
done:
    release(&held);
    return result;
}
