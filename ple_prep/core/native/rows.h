/* Where a row sits in a table's data region, and the slot lookup from row ids: shared by both
 * compiled modules (core/native/module.c, runtime/native/stage.c). */
#ifndef PLE_PREP_ROWS_H
#define PLE_PREP_ROWS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Ids looked at ahead of the one being resolved: enough misses in flight to cover memory latency. */
#define PREFETCH_AHEAD 16
/* The rank pass's distance: its one miss per id costs little to compute, so more ids run ahead
 * (64 against 16: the pass about 20% faster on 18,000 ids over a 40M-row index here). */
#define RANK_PREFETCH_AHEAD 64

/* Where slot `slot`'s row starts in the data region `data` (format/pages.py: rows fill pages from
 * their start, the rest of a page is padding). */
static inline const char *row_address(const char *data, int64_t slot, Py_ssize_t page_size,
                                      Py_ssize_t rows_per_page, Py_ssize_t row_bytes)
{
    return data + (slot / rows_per_page) * page_size + (slot % rows_per_page) * row_bytes;
}

static inline void prefetch_row(const char *row, Py_ssize_t row_bytes)
{
    for (Py_ssize_t line = 0; line < row_bytes; line += 64)
        __builtin_prefetch(row + line);
    __builtin_prefetch(row + row_bytes - 1);
}

/* format/order.py's rank index. `rank_words`: for each 64 rows a pair of words, their bits (row
 * 64 * w + b is bit b of pair w's first word) and the placed rows before them: one 16-byte read and
 * one popcount a lookup. `packed_slots`: each placed row's slot, rows ascending, in
 * slot_bits(num_placed) bits each, little-endian, in whole 8-byte words and then 8 zero bytes (a
 * read loads the 8 bytes from a slot's first). */

/* Bits a packed slot takes: enough for num_placed - 1, at least 1. */
static inline int slot_bits(int64_t num_placed)
{
    return num_placed > 1 ? 64 - __builtin_clzll((uint64_t)(num_placed - 1)) : 1;
}

static inline Py_ssize_t packed_slots_bytes(int64_t num_placed)
{
    return num_placed ? (Py_ssize_t)(8 * (((uint64_t)num_placed * (uint64_t)slot_bits(num_placed) + 63) / 64) + 8) : 0;
}

/* The placed rows an index of `rank_bytes` of pairs and `packed_bytes` of slots counts (the last
 * pair's count and bits), or -1 where the two do not make an index of `num_rows` rows. */
static inline int64_t rank_index_placed(const uint64_t *rank_words, Py_ssize_t rank_bytes, Py_ssize_t packed_bytes,
                                        int64_t num_rows)
{
    Py_ssize_t pairs = rank_bytes / (Py_ssize_t)(2 * sizeof(uint64_t));
    if (rank_bytes % (Py_ssize_t)(2 * sizeof(uint64_t)))
        return -1;
    int64_t placed = pairs ? (int64_t)rank_words[2 * pairs - 1] + __builtin_popcountll(rank_words[2 * pairs - 2]) : 0;
    return placed && (pairs * 64 < num_rows || placed > num_rows || packed_bytes < packed_slots_bytes(placed))
        ? -1 : placed;
}

static inline __attribute__((always_inline)) uint64_t packed_slot(const uint8_t *packed, int64_t index, int bits)
{
    uint64_t bit = (uint64_t)index * (uint64_t)bits, value;
    memcpy(&value, packed + (bit >> 3), sizeof value);
    return (value >> (bit & 7)) & (((uint64_t)1 << bits) - 1);
}

/* find_slots(row, count, first_row, limit, rank_words, packed_slots, num_placed, target, bad):
 * target[i] = the file slot of row id row[i] from the rank index above; local rows (ids less
 * first_row) outside [0, limit) are refused (*bad = their position, else -1). Placed rows get their
 * slot from `packed_slots`, the others follow the placed ones in row order; without placed rows a
 * slot is the row. */
typedef void find_slots_fn(const int64_t *, Py_ssize_t, int64_t, int64_t, const uint64_t *, const uint8_t *,
                           int64_t, int64_t *, Py_ssize_t *);
extern find_slots_fn *find_slots;

/* Picks find_slots' fastest variant for this CPU; called once, at a module's import. */
void select_find_slots(void);

/* The error of a lookup that met a row id outside [first_row, first_row + num_rows). */
void refuse_row_id(int64_t id, long long first_row, long long num_rows);

#endif
