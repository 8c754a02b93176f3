#include "rows.h"

/* find_slots (rows.h), inlined into each variant below. */
static inline __attribute__((always_inline)) void find_slots_body(
    const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit, const uint64_t *rank_words,
    const uint8_t *packed_slots, int64_t num_placed, int64_t *target, Py_ssize_t *bad)
{
    *bad = -1;
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
     * row's rank (placed rows below it, negated for a placed row) from the one 16-byte pair of its
     * 64 rows (rows.h), then the placed rows' packed slots. */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + RANK_PREFETCH_AHEAD < count) {
            uint64_t ahead = ((uint64_t)row[i + RANK_PREFETCH_AHEAD] - (uint64_t)first_row) >> 6;
            if (ahead < (uint64_t)limit >> 6)
                __builtin_prefetch(&rank_words[2 * ahead]);
        }
        uint64_t local = (uint64_t)row[i] - (uint64_t)first_row;
        if (local >= (uint64_t)limit) {
            *bad = i;
            return;
        }
        int64_t r = (int64_t)local;
        /* The row's bit moved to the top: it says whether the row is placed, and the bits at and
         * below it count the placed rows up to it. */
        const uint64_t *pair = &rank_words[2 * (r >> 6)];
        uint64_t bits_to_row = pair[0] << (63 - (r & 63));
        int64_t placed = (int64_t)(bits_to_row >> 63);
        int64_t position = (int64_t)pair[1] + __builtin_popcountll(bits_to_row) - placed;
        if (placed && position >= num_placed) {
            *bad = i;
            return;
        }
        target[i] = placed ? -1 - position : num_placed + r - position;
    }
    const int bits = slot_bits(num_placed);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_AHEAD < count && target[i + PREFETCH_AHEAD] < 0)
            __builtin_prefetch(&packed_slots[(uint64_t)(-1 - target[i + PREFETCH_AHEAD]) * (uint64_t)bits >> 3]);
        if (target[i] < 0)
            target[i] = (int64_t)packed_slot(packed_slots, -1 - target[i], bits);
    }
}

static void find_slots_portable(const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit,
                                const uint64_t *rank_words, const uint8_t *packed_slots, int64_t num_placed,
                                int64_t *target, Py_ssize_t *bad)
{
    find_slots_body(row, count, first_row, limit, rank_words, packed_slots, num_placed, target, bad);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same loop with the popcnt instruction, which x86-64's baseline lacks (the portable build
 * counts bits in a library call that doubles the rank pass); chosen at import where the CPU has it. */
__attribute__((target("popcnt"))) static void find_slots_popcnt(
    const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit, const uint64_t *rank_words,
    const uint8_t *packed_slots, int64_t num_placed, int64_t *target, Py_ssize_t *bad)
{
    find_slots_body(row, count, first_row, limit, rank_words, packed_slots, num_placed, target, bad);
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
