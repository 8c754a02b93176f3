#include "rows.h"

/* find_slots (rows.h), inlined into each variant below. */
static inline __attribute__((always_inline)) void find_slots_body(
    const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit, const rank_index *index,
    int64_t *target, Py_ssize_t *bad)
{
    *bad = -1;
    int64_t num_placed = index->num_placed;
    /* Local rows in unsigned arithmetic: id - first_row wraps instead of overflowing (an id of
     * -2**63 on a rank table), and every id outside [first_row, first_row + limit) lands at or
     * above `limit`. */
    if (num_placed == 0) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t r = (uint64_t)row[i] - (uint64_t)first_row;
            if (r >= (uint64_t)limit) {
                *bad = i;
                return;
            }
            target[i] = (int64_t)r;
        }
        return;
    }
    /* Two passes, each prefetching ids ahead, so the cache misses of many ids overlap: first each
     * row's rank (placed rows below it, negated for a placed row) from the one line of its rows
     * (format/order.py), then the placed rows' slots. */
    const uint64_t *lines = index->lines;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + RANK_PREFETCH_AHEAD < count) {
            uint64_t ahead = ((uint64_t)row[i + RANK_PREFETCH_AHEAD] - (uint64_t)first_row) / RANK_LINE_ROWS;
            if (ahead < ((uint64_t)limit + RANK_LINE_ROWS - 1) / RANK_LINE_ROWS)
                __builtin_prefetch(&lines[RANK_LINE_WORDS * ahead]);
        }
        uint64_t local = (uint64_t)row[i] - (uint64_t)first_row;
        if (local >= (uint64_t)limit) {
            *bad = i;
            return;
        }
        const uint64_t *line = &lines[RANK_LINE_WORDS * (local / RANK_LINE_ROWS)];
        uint64_t within = local % RANK_LINE_ROWS, word = within >> 6;
        /* The row's bit moved to the top: it says whether the row is placed, and the bits at and
         * below it count the placed rows up to it; the line's words before it add theirs (a mask
         * instead of a branch on how many). */
        uint64_t bits_to_row = line[1 + word] << (63 - (within & 63));
        int64_t placed = (int64_t)(bits_to_row >> 63);
        int64_t position = (int64_t)line[0] + __builtin_popcountll(bits_to_row) - placed;
        for (uint64_t k = 0; k < RANK_LINE_WORDS - 2; k++)
            position += __builtin_popcountll(line[1 + k] & -(uint64_t)(k < word));
        if (placed && position >= num_placed) {
            *bad = i;
            return;
        }
        target[i] = placed ? -1 - position : num_placed + (int64_t)local - position;
    }
    const uint64_t *packed = index->packed;
    int width = index->width;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_AHEAD < count && target[i + PREFETCH_AHEAD] < 0)
            __builtin_prefetch((const char *)packed + ((uint64_t)(-1 - target[i + PREFETCH_AHEAD]) * width >> 3));
        if (target[i] < 0)
            target[i] = (int64_t)packed_value(packed, (uint64_t)(-1 - target[i]), width);
    }
}

int rank_index_from(rank_index *index, const Py_buffer *lines, const Py_buffer *packed, long long num_placed,
                    int width, long long num_rows, const char *caller)
{
    Py_ssize_t line_bytes = RANK_LINE_WORDS * (Py_ssize_t)sizeof(uint64_t);
    /* The last value's 8-byte load ends within the spare word. */
    long long packed_words = num_placed ? (num_placed * (long long)width + 63) / 64 + 1 : 0;
    if (num_rows < 0 || num_placed < 0 || num_placed > num_rows || width < 1 || width > 32
        || (num_placed && lines->len != (num_rows + RANK_LINE_ROWS - 1) / RANK_LINE_ROWS * line_bytes)
        || lines->len % line_bytes || packed->len != packed_words * (long long)sizeof(uint64_t)
        || (num_placed > 1 && (uint64_t)(num_placed - 1) >> width)) {
        PyErr_Format(PyExc_ValueError, "%s: the rank index does not fit the table", caller);
        return -1;
    }
    *index = (rank_index){.lines = lines->buf, .packed = packed->buf, .num_placed = num_placed, .width = width};
    return 0;
}

static void find_slots_portable(const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit,
                                const rank_index *index, int64_t *target, Py_ssize_t *bad)
{
    find_slots_body(row, count, first_row, limit, index, target, bad);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same loop with the popcnt instruction, which x86-64's baseline lacks (the portable build
 * counts bits in a library call that doubles the rank pass); chosen at import where the CPU has it. */
__attribute__((target("popcnt"))) static void find_slots_popcnt(
    const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit, const rank_index *index,
    int64_t *target, Py_ssize_t *bad)
{
    find_slots_body(row, count, first_row, limit, index, target, bad);
}
#endif

find_slots_fn *find_slots = find_slots_portable;

void select_find_slots(void)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("popcnt"))
        find_slots = find_slots_popcnt;
#endif
}

void refuse_row_id(int64_t id, long long first_row, long long num_rows)
{
    PyErr_Format(PyExc_IndexError, "row id %lld is outside this table's rows [%lld, %lld)", (long long)id, first_row,
                 first_row + num_rows);
}
