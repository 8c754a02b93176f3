/* The host half of a tiered lookup (stage.c): a request's slots, its resident tier index, and its
 * cached disk rows staged for a device's copy, split over the pool's threads. */
#ifndef PLE_PREP_STAGE_H
#define PLE_PREP_STAGE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "../../core/native/buffers.h"
#include "pool.h"

typedef struct {
    const int64_t *id;
    Py_ssize_t count;
    int64_t first_row, num_rows, num_placed, num_resident;
    const uint64_t *rank_words;
    const uint32_t *slot_by_rank;
    const char *data;
    Py_ssize_t page_size, rows_per_page, row_bytes;
    char *out;
    int64_t *slots;
    int32_t *index;
    int parts;
    Py_ssize_t disk[MAX_THREADS], first[MAX_THREADS], bad[MAX_THREADS];
} stage_request;

/* A stage call's buffers and request, from its arguments (checked), or NULL with an exception set. */
typedef struct {
    held_buffers held;
    stage_request request;
    Py_ssize_t out_rows, probes;
    long long first_row, num_rows;
    /* After run_stage: */
    Py_ssize_t bad, disk;
    int staged;
} stage_call;

/* A stage call's buffers and request, from stage's Python arguments (checked), or NULL with an
 * exception set. */
stage_call *new_stage_call(PyObject *args);

/* The stage itself; runs without the GIL. */
void run_stage(stage_call *call);

/* (disk, staged) of a run stage, or NULL with its error; the call's buffers are released. */
PyObject *finish_stage(stage_call *call);

/* Whether the memory page holding `address` is in the page cache (mincore). */
int page_cached(const char *address);

#endif
