/* The planner's loops over groups (ple_prep/offline/planner.py, whose numpy and Python code is the
 * fallback with the same results): one step per group in C, where the fallback took seconds for
 * the model's millions of groups.
 *
 * take_new_rows(rows, heads, taken, new_rows, filled, new_per_group) -> filled
 *     `_new_rows`'s step over a chunk of groups: rows (int64, groups x heads, local row ids, -1
 *     outside the slice) in order, each row not yet set in the bitmap `taken` (uint64 words) set
 *     there and appended to new_rows (uint32) from `filled`, new_per_group[g] (uint8) its group's
 *     count of them; returns the new `filled`. ValueError where new_rows or new_per_group is too
 *     short, or a row lies beyond the bitmap.
 *
 * pack_groups(sizes, capacity, spare, piece_group, piece_first, piece_count) -> n
 *     Groups of sizes[g] rows (uint8, hottest first) ordered into pages of `capacity` slots; the
 *     pieces in slot order into piece_group[:n] (int32: a group, or len(sizes) for the spare pool),
 *     piece_first[:n] (int64: the piece's first row of its group or of the pool) and
 *     piece_count[:n] (uint8 where capacity < 256, else int64), the three of one length; -1 when
 *     they are too short for the pieces (the caller retries with longer ones).
 */
#include <string.h>

#include "buffers.h"
#include "pack.h"

/* Per size up to a page, group indices ascending: the coldest of a size is popped from the end; a
 * cut group is pushed to the queue of its smaller size. */
typedef struct {
    int32_t *items;
    Py_ssize_t length, allocated;
} queue;

static int push(queue *q, int32_t group)
{
    if (q->length == q->allocated) {
        Py_ssize_t allocated = q->allocated ? 2 * q->allocated : 16;
        int32_t *items = realloc(q->items, (size_t)allocated * sizeof(int32_t));
        if (!items)
            return -1;
        q->items = items;
        q->allocated = allocated;
    }
    q->items[q->length++] = group;
    return 0;
}

PyObject *pack_groups(PyObject *self, PyObject *args)
{
    PyObject *sizes_object, *group_object, *first_object, *count_object;
    Py_ssize_t capacity;
    long long spare;
    if (!PyArg_ParseTuple(args, "OnLOOO", &sizes_object, &capacity, &spare, &group_object, &first_object,
                          &count_object))
        return NULL;
    if (capacity < 1 || spare < 0) {
        PyErr_SetString(PyExc_ValueError, "pack_groups: capacity must be >= 1 and spare >= 0");
        return NULL;
    }
    Py_ssize_t count_item = capacity < 256 ? 1 : 8;
    int largest = 0;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    uint8_t *remaining = NULL, *taken = NULL;
    queue *queues = NULL;
    Py_buffer *sizes, *groups, *firsts, *counts;
    if (!(sizes = hold(&held, sizes_object, 0, 1, "sizes"))
        || !(groups = hold(&held, group_object, 1, sizeof(int32_t), "piece_group"))
        || !(firsts = hold(&held, first_object, 1, sizeof(int64_t), "piece_first"))
        || !(counts = hold(&held, count_object, 1, count_item, "piece_count")))
        goto done;
    Py_ssize_t pool = sizes->len, bound = groups->len / (Py_ssize_t)sizeof(int32_t);
    if (pool >= INT32_MAX || firsts->len / 8 < bound || counts->len / count_item < bound) {
        PyErr_SetString(PyExc_ValueError, "pack_groups: the piece arrays differ in length, or too many groups");
        goto done;
    }
    const uint8_t *size_of = sizes->buf;
    for (Py_ssize_t g = 0; g < pool; g++)
        largest = size_of[g] > largest ? size_of[g] : largest;
    remaining = malloc(pool ? pool : 1);
    taken = calloc(pool ? pool : 1, 1);
    queues = calloc((size_t)largest + 1, sizeof(queue));
    if (!remaining || !taken || !queues) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(remaining, size_of, pool);
    Py_ssize_t *of_size = calloc((size_t)largest + 1, sizeof(Py_ssize_t));
    if (!of_size) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t g = 0; g < pool; g++)
        of_size[size_of[g]]++;
    int failed = 0;
    for (int size = 1; size <= largest && size <= capacity && !failed; size++)
        if (of_size[size] && !(queues[size].items = malloc((size_t)of_size[size] * sizeof(int32_t))))
            failed = 1;
        else
            queues[size].allocated = of_size[size];
    free(of_size);
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t g = 0; g < pool; g++)
        if (size_of[g] && size_of[g] <= capacity) {
            queue *q = &queues[size_of[g]];
            q->items[q->length++] = (int32_t)g;
        }

    int32_t *piece_group = groups->buf;
    int64_t *piece_first = firsts->buf;
    uint8_t *count_small = counts->buf;
    int64_t *count_large = counts->buf;
    Py_ssize_t pieces = 0, front = 0, back = pool - 1, fill = 0;
    long long pool_left = spare, pool_taken = 0;
    int overflow = 0, no_memory = 0;
    Py_BEGIN_ALLOW_THREADS
#define PLACE(group, number)                                                                              \
    do {                                                                                                  \
        Py_ssize_t placed_group = (group);                                                                \
        long long placed_count = (number);                                                                \
        if (pieces >= bound) {                                                                            \
            overflow = 1;                                                                                 \
            goto finished;                                                                                \
        }                                                                                                 \
        piece_group[pieces] = (int32_t)placed_group;                                                      \
        if (placed_group == pool) {                                                                       \
            piece_first[pieces] = pool_taken;                                                             \
            pool_taken += placed_count;                                                                   \
            pool_left -= placed_count;                                                                    \
        } else {                                                                                          \
            piece_first[pieces] = taken[placed_group];                                                    \
            taken[placed_group] += (uint8_t)placed_count;                                                 \
            remaining[placed_group] -= (uint8_t)placed_count;                                             \
        }                                                                                                 \
        if (count_item == 1)                                                                              \
            count_small[pieces] = (uint8_t)placed_count;                                                  \
        else                                                                                              \
            count_large[pieces] = placed_count;                                                           \
        pieces++;                                                                                         \
        fill = (Py_ssize_t)((fill + placed_count) % capacity);                                            \
    } while (0)
    for (;;) {
        while (front < pool && remaining[front] == 0)
            front++;
        if (front == pool)
            break;
        Py_ssize_t free_slots = capacity - fill;
        int size = remaining[front];
        if (size <= free_slots || size > capacity) {
            PLACE(front, size);
            front++;
            continue;
        }
        Py_ssize_t filler = -1;
        for (int want = (int)(free_slots < largest ? free_slots : largest); want > 0; want--) {
            queue *q = &queues[want];
            while (q->length && (remaining[q->items[q->length - 1]] != want || q->items[q->length - 1] <= front))
                q->length--;
            if (q->length) {
                filler = q->items[--q->length];
                break;
            }
        }
        if (filler >= 0) {
            PLACE(filler, remaining[filler]);
        } else if (pool_left) {
            PLACE(pool, free_slots < pool_left ? free_slots : pool_left);
        } else {
            while (remaining[back] == 0)
                back--;
            if (back == front) {
                PLACE(front, remaining[front]);
                continue;
            }
            /* Nothing else fits the page's end: cut the coldest group to fill it. */
            PLACE(back, free_slots);
            if (push(&queues[remaining[back]], (int32_t)back) != 0) {
                no_memory = 1;
                break;
            }
        }
    }
#undef PLACE
finished:
    Py_END_ALLOW_THREADS
    if (no_memory) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromSsize_t(overflow ? -1 : pieces);
done:
    free(remaining);
    free(taken);
    if (queues)
        for (int size = 0; size <= largest; size++)
            free(queues[size].items);
    free(queues);
    release(&held);
    return result;
}

PyObject *take_new_rows(PyObject *self, PyObject *args)
{
    PyObject *rows_object, *taken_object, *new_object, *per_group_object;
    Py_ssize_t heads, filled;
    if (!PyArg_ParseTuple(args, "OnOOnO", &rows_object, &heads, &taken_object, &new_object, &filled,
                          &per_group_object))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *rows, *taken, *fresh, *per_group;
    if (!(rows = hold(&held, rows_object, 0, sizeof(int64_t), "rows"))
        || !(taken = hold(&held, taken_object, 1, sizeof(uint64_t), "taken"))
        || !(fresh = hold(&held, new_object, 1, sizeof(uint32_t), "new_rows"))
        || !(per_group = hold(&held, per_group_object, 1, 1, "new_per_group")))
        goto done;
    Py_ssize_t count = rows->len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t groups = heads > 0 ? count / heads : 0;
    Py_ssize_t capacity = fresh->len / (Py_ssize_t)sizeof(uint32_t);
    int64_t bits = (int64_t)(taken->len / (Py_ssize_t)sizeof(uint64_t)) * 64;
    if (heads < 1 || heads > 255 || groups * heads != count || per_group->len < groups || filled < 0
        || filled > capacity) {
        PyErr_SetString(PyExc_ValueError, "take_new_rows: rows are not groups x heads (1 to 255), or a count is short");
        goto done;
    }
    const int64_t *row = rows->buf;
    uint64_t *words = taken->buf;
    uint32_t *out = fresh->buf;
    uint8_t *per = per_group->buf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < groups && !failed; g++) {
        uint8_t found = 0;
        for (Py_ssize_t h = 0; h < heads; h++) {
            int64_t local = row[g * heads + h];
            if (local < 0)
                continue;
            if (local >= bits || filled == capacity) {
                failed = 1;
                break;
            }
            uint64_t bit = (uint64_t)1 << (local & 63);
            if (words[local >> 6] & bit)
                continue;
            words[local >> 6] |= bit;
            out[filled++] = (uint32_t)local;
            found++;
        }
        per[g] = found;
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_SetString(PyExc_ValueError, "take_new_rows: a row beyond the bitmap, or new_rows too short");
        goto done;
    }
    result = PyLong_FromSsize_t(filled);
done:
    release(&held);
    return result;
}
