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
    const uint8_t *packed_slots;
    const char *data, *mapping; /* the data region, and the mapping's first byte (the file's) */
    Py_ssize_t page_size, rows_per_page, row_bytes, num_slots;
    char *out;
    int64_t *slots;
    int32_t *index;
    int parts;
    Py_ssize_t disk[MAX_THREADS], first[MAX_THREADS], bad[MAX_THREADS];
    /* What a part's copy met: a page the kernel could not read (its address), or slots that the
     * caller changed while they were copied (a position outside the table, or more disk rows than
     * the part counted). */
    const char *fault[MAX_THREADS];
    int faulted[MAX_THREADS], raced[MAX_THREADS];
} stage_request;

/* A stage call's buffers and request, from its arguments (checked), or NULL with an exception set. */
typedef struct {
    held_buffers held;
    PyObject *view; /* the table's TableView (view.h), held: the mapping and rank index are its */
    stage_request request;
    Py_ssize_t out_rows, probes;
    long long first_row, num_rows;
    /* After run_stage: */
    Py_ssize_t bad, disk;
    int staged, probe_error; /* probe_error: mincore's errno when it failed */
} stage_call;

/* A stage call's buffers and request, from stage's Python arguments (view, ids, num_resident,
 * slots, index, out, probes, threads; checked), or NULL with an exception set. */
stage_call *new_stage_call(PyObject *args);

/* Release a call's buffers and view and free it (with the GIL). */
void free_stage_call(stage_call *call);

/* The stage itself; runs without the GIL. */
void run_stage(stage_call *call);

/* (disk, staged) of a run stage, or NULL with its error; the call is freed. */
PyObject *finish_stage(stage_call *call);

/* Whether the memory page holding `address` is in the page cache (mincore): 1 or 0, or -1 with
 * errno set when mincore fails. */
int page_cached(const char *address);

#endif
