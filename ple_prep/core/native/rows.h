/* Where a row sits in a table's data region, and the slot lookup from row ids: shared by both
 * compiled modules (core/native/module.c, runtime/native/stage.c). */
#ifndef PLE_PREP_ROWS_H
#define PLE_PREP_ROWS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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

/* find_slots(row, count, first_row, limit, rank_words, slot, num_placed, target, bad): target[i] =
 * the file slot of row id row[i] from format/order.py's rank index; local rows (ids less first_row)
 * outside [0, limit) are refused (*bad = their position, else -1). Placed rows get their slot from
 * `slot`, the others follow the placed ones in row order; without placed rows a slot is the row. */
typedef void find_slots_fn(const int64_t *, Py_ssize_t, int64_t, int64_t, const uint64_t *, const uint32_t *,
                           int64_t, int64_t *, Py_ssize_t *);
extern find_slots_fn *find_slots;

/* Picks find_slots' fastest variant for this CPU; called once, at a module's import. */
void select_find_slots(void);

/* The error of a lookup that met a row id outside [first_row, first_row + num_rows). */
void refuse_row_id(int64_t id, long long first_row, long long num_rows);

#endif
