/* The host lookup's hot loops, compiled when a compiler is there at install (setup.py);
 * ple_prep/runtime/gather.py and ple_prep/format/order.py hold the numpy fallback of each, with
 * the same results bit for bit (the CUDA driver calls at the end have none: runtime/torch.py uses
 * torch's copies without the helper). All release the GIL, so work split over threads scales.
 *
 * copy_rows(mapping, slots, out, data_offset, page_size, rows_per_page, row_bytes, num_slots)
 *     out[i] = the row at file slot slots[i]: one memcpy per row, straight into `out`.
 * slot_of(ids, first_row, num_rows, rank_words, sorted_slots, out)
 *     out[i] = the file slot of row id ids[i] (local row ids[i] - first_row, refused outside
 *     [0, num_rows)), from format/order.py's rank index (the identity where sorted_slots is empty).
 * stage(ids, first_row, num_rows, rank_words, sorted_slots, num_resident, slots, index, mapping, out,
 *       data_offset, page_size, rows_per_page, row_bytes, num_slots, probes, threads) -> (disk, staged)
 *     The host half of a tiered lookup (runtime/gather.py's Gatherer.stage): slots[i] = the file
 *     slot of row id ids[i] (the identity where sorted_slots is empty), index[i] = that slot where
 *     it is below num_resident (the resident tier's rows); `disk` counts the other positions. If
 *     `probes` rows spread over those are in the page cache, the k-th of them (in position order)
 *     is copied to row len(out) - disk + k of `out` and index[i] = num_resident + that row, and
 *     `staged` is true. Split over `threads` threads (a pool kept by this module). `out` and
 *     `index` are written past the CPU caches (store_row_uncached): a device copies them next.
 * stage_when(flags, ids_value, free_value, copy, *the arguments of stage) -> job
 * stage_joined(job, cancel=False) -> ((disk, staged), copied)
 *     `stage` on a thread of its own, started once flags[0] == ids_value and flags[1] == free_value
 *     (written by a device into pinned memory; a value below 0 is not waited for), and its result
 *     (runtime/torch.py's device ids). With a `copy` (not None) the thread then queues the staged
 *     rows' copy to the device itself, and `copied` says it did; with `cancel`, a job not yet
 *     started stages nothing and None is returned.
 * device_context(ordinal) -> context
 * queue_ids_copy(context, stream, event, target, source, bytes, flag, flag_source)
 *     A device's CUDA primary context, and a start's ids copy to pinned memory as driver calls.
 * stage_and_launch(context, events, graph, stream, *the arguments of stage) -> ((disk, staged), launched)
 *     `stage` once CUDA events have completed, then, if the rows were staged, a CUDA graph's launch:
 *     a small device-ids request's finish in one call.
 * cached(mapping, slots, data_offset, page_size, rows_per_page, row_bytes, num_slots, probes)
 *     Whether the memory page holding the first byte of each of `probes` rows spread over the
 *     request (first and last included) is in the page cache (mincore); slots outside the table are
 *     left to copy_rows to refuse.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Ids looked at ahead of the one being resolved: enough misses in flight to cover memory latency. */
#define PREFETCH_AHEAD 16
/* The rank pass's distance: its one miss per id costs little to compute, so more ids run ahead
 * (64 against 16: the pass about 20% faster on 18,000 ids over a 40M-row index here). */
#define RANK_PREFETCH_AHEAD 64

/* A C-contiguous buffer of `item`-byte elements (an array of the right dtype's size), refused with
 * a ValueError naming it otherwise: the callers' arrays are checked here, once, not in Python. */
static int get_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t item, const char *name)
{
    if (PyObject_GetBuffer(object, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) != 0) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError) && !PyErr_ExceptionMatches(PyExc_BufferError))
            return -1;
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s array", name, writable ? ", writable" : "");
        return -1;
    }
    if (view->itemsize != item) {
        PyErr_Format(PyExc_ValueError, "%s must be an array of %zd-byte items, not %zd-byte ones", name, item,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A table's page geometry, refused unless rows fit their pages (format/header.py checks the same
 * at open; this guards the pointer arithmetic below). */
static int check_geometry(Py_ssize_t data_offset, Py_ssize_t page_size, Py_ssize_t rows_per_page,
                          Py_ssize_t row_bytes, Py_ssize_t num_slots)
{
    if (row_bytes <= 0 || rows_per_page <= 0 || rows_per_page * row_bytes > page_size || data_offset < 0
        || num_slots < 0) {
        PyErr_SetString(PyExc_ValueError, "bad table geometry");
        return -1;
    }
    return 0;
}

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

/* --- Stores past the CPU caches (non-temporal) for what a device copies next: rows that the
 * pool's threads leave modified in their own caches are read by the device's copy at a third of
 * its speed (each line fetched from a core's cache; BENCHMARKS.md), rows in memory at full speed.
 * Where SSE2 is missing, or a row is not in 16-byte pieces at a 16-byte boundary (NVFP4's), a
 * plain copy. stores_done() orders them before the part that made them is counted done. */

static inline void store_row_uncached(char *target, const char *source, Py_ssize_t row_bytes)
{
#if defined(__SSE2__)
    if (((uintptr_t)target & 15) == 0 && row_bytes % 16 == 0) {
        for (Py_ssize_t offset = 0; offset < row_bytes; offset += 16)
            _mm_stream_si128((__m128i *)(target + offset), _mm_loadu_si128((const __m128i *)(source + offset)));
        return;
    }
#endif
    memcpy(target, source, (size_t)row_bytes);
}

static inline void store_index_uncached(int32_t *target, int32_t value)
{
#if defined(__SSE2__)
    _mm_stream_si32((int *)target, value);
#else
    *target = value;
#endif
}

static inline void stores_done(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* Whether the memory page holding `address` is in the page cache (mincore). */
static int page_cached(const char *address)
{
    uintptr_t system_page = (uintptr_t)sysconf(_SC_PAGESIZE), at = (uintptr_t)address;
    unsigned char state = 0;
    return mincore((void *)(at - at % system_page), 1, &state) == 0 && (state & 1);
}

/* The buffers a call holds, released together on every way out. */
typedef struct {
    Py_buffer views[8];
    int held;
} held_buffers;

static void release(held_buffers *held)
{
    while (held->held)
        PyBuffer_Release(&held->views[--held->held]);
}

static Py_buffer *hold(held_buffers *held, PyObject *object, int writable, Py_ssize_t item, const char *name)
{
    Py_buffer *view = &held->views[held->held];
    if (get_buffer(object, view, writable, item, name) != 0)
        return NULL;
    held->held++;
    return view;
}

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    PyObject *mapping_object, *slots_object, *out_object;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots;
    if (!PyArg_ParseTuple(args, "OOOnnnnn", &mapping_object, &slots_object, &out_object, &data_offset,
                          &page_size, &rows_per_page, &row_bytes, &num_slots)
        || check_geometry(data_offset, page_size, rows_per_page, row_bytes, num_slots) != 0)
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *mapping, *slots, *out;
    if (!(mapping = hold(&held, mapping_object, 0, 1, "mapping"))
        || !(slots = hold(&held, slots_object, 0, sizeof(int64_t), "slots"))
        || !(out = hold(&held, out_object, 1, 1, "out")))
        goto done;
    Py_ssize_t count = slots->len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t num_pages = (num_slots + rows_per_page - 1) / rows_per_page;
    if (out->len != count * row_bytes) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not %zd rows of %zd", out->len, count, row_bytes);
        goto done;
    }
    if (data_offset + num_pages * page_size > mapping->len) {
        PyErr_SetString(PyExc_ValueError, "the mapping is shorter than its pages");
        goto done;
    }
    const int64_t *slot = (const int64_t *)slots->buf;
    const char *data = (const char *)mapping->buf + data_offset;
    char *target = (char *)out->buf;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_AHEAD < count && (uint64_t)slot[i + PREFETCH_AHEAD] < (uint64_t)num_slots)
            prefetch_row(row_address(data, slot[i + PREFETCH_AHEAD], page_size, rows_per_page, row_bytes), row_bytes);
        if ((uint64_t)slot[i] >= (uint64_t)num_slots) {
            bad = i;
            break;
        }
        memcpy(target + i * row_bytes, row_address(data, slot[i], page_size, rows_per_page, row_bytes),
               (size_t)row_bytes);
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "slot %lld is outside the table's %zd slots", (long long)slot[bad],
                     num_slots);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&held);
    return result;
}

/* Local rows (ids less first_row) outside [0, limit) are refused (*bad = their position). Placed rows get their slot from sorted_slots, the others
 * follow the placed ones in row order; without placed rows a slot is the row. */
static inline __attribute__((always_inline)) void find_slots_body(
    const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit, const uint64_t *rank_words,
    const uint32_t *slot, int64_t num_placed, int64_t *target, Py_ssize_t *bad)
{
    *bad = -1;
    if (num_placed == 0) {
        for (Py_ssize_t i = 0; i < count; i++) {
            int64_t r = row[i] - first_row;
            if (r < 0 || r >= limit) {
                *bad = i;
                return;
            }
            target[i] = r;
        }
        return;
    }
    /* Two passes, each prefetching ids ahead, so the cache misses of many ids overlap: first each
     * row's rank (placed rows below it, negated for a placed row) from the one 16-byte pair of its
     * 64 rows (format/order.py), then the placed rows' slots. */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + RANK_PREFETCH_AHEAD < count) {
            uint64_t ahead = (uint64_t)(row[i + RANK_PREFETCH_AHEAD] - first_row) >> 6;
            if (ahead < (uint64_t)limit >> 6)
                __builtin_prefetch(&rank_words[2 * ahead]);
        }
        int64_t r = row[i] - first_row;
        if (r < 0 || r >= limit) {
            *bad = i;
            return;
        }
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
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_AHEAD < count && target[i + PREFETCH_AHEAD] < 0)
            __builtin_prefetch(&slot[-1 - target[i + PREFETCH_AHEAD]]);
        if (target[i] < 0)
            target[i] = slot[-1 - target[i]];
    }
}

typedef void find_slots_fn(const int64_t *, Py_ssize_t, int64_t, int64_t, const uint64_t *, const uint32_t *,
                           int64_t, int64_t *, Py_ssize_t *);

static void find_slots_portable(const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit,
                                const uint64_t *rank_words, const uint32_t *slot, int64_t num_placed,
                                int64_t *target, Py_ssize_t *bad)
{
    find_slots_body(row, count, first_row, limit, rank_words, slot, num_placed, target, bad);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same loop with the popcnt instruction, which x86-64's baseline lacks (the portable build
 * counts bits in a library call that doubles the rank pass); chosen at import where the CPU has it. */
__attribute__((target("popcnt"))) static void find_slots_popcnt(
    const int64_t *row, Py_ssize_t count, int64_t first_row, int64_t limit, const uint64_t *rank_words,
    const uint32_t *slot, int64_t num_placed, int64_t *target, Py_ssize_t *bad)
{
    find_slots_body(row, count, first_row, limit, rank_words, slot, num_placed, target, bad);
}
#endif

static find_slots_fn *find_slots = find_slots_portable;

/* The error of a lookup that met a row id outside [first_row, first_row + num_rows). */
static void refuse_row_id(int64_t id, long long first_row, long long num_rows)
{
    PyErr_Format(PyExc_IndexError, "row id %lld is outside this table's rows [%lld, %lld)", (long long)id, first_row,
                 first_row + num_rows);
}

static PyObject *slot_of(PyObject *self, PyObject *args)
{
    PyObject *ids_object, *rank_words_object, *sorted_slots_object, *out_object;
    long long first_row, num_rows;
    if (!PyArg_ParseTuple(args, "OLLOOO", &ids_object, &first_row, &num_rows, &rank_words_object,
                          &sorted_slots_object, &out_object))
        return NULL;
    held_buffers held = {.held = 0};
    PyObject *result = NULL;
    Py_buffer *ids, *rank_words, *sorted_slots, *out;
    if (!(ids = hold(&held, ids_object, 0, sizeof(int64_t), "ids"))
        || !(rank_words = hold(&held, rank_words_object, 0, sizeof(uint64_t), "rank_words"))
        || !(sorted_slots = hold(&held, sorted_slots_object, 0, sizeof(uint32_t), "sorted_slots"))
        || !(out = hold(&held, out_object, 1, sizeof(int64_t), "out")))
        goto done;
    Py_ssize_t num_words = rank_words->len / (Py_ssize_t)(2 * sizeof(uint64_t));
    int64_t num_placed = sorted_slots->len / (Py_ssize_t)sizeof(uint32_t);
    if (out->len != ids->len || rank_words->len % (Py_ssize_t)(2 * sizeof(uint64_t)) || num_rows < 0
        || (num_placed && num_words * 64 < num_rows)) {
        PyErr_SetString(PyExc_ValueError, "slot_of: mismatched array sizes");
        goto done;
    }
    const int64_t *id = (const int64_t *)ids->buf;
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    find_slots(id, ids->len / (Py_ssize_t)sizeof(int64_t), first_row, num_rows, (const uint64_t *)rank_words->buf,
               (const uint32_t *)sorted_slots->buf, num_placed, (int64_t *)out->buf, &bad);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        refuse_row_id(id[bad], first_row, num_rows);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&held);
    return result;
}

/* --- A small thread pool for `stage`: Python's threads pay a GIL handoff and a queue per part,
 * which on a virtual machine's slow wakeups cost more than the part itself. Workers take parts of
 * the current job by claiming them from one atomic ticket (generation, parts, next part), poll
 * for the next job for SPIN_NS after finishing one (a request's copy phase, which follows its
 * lookup within microseconds, then starts at once) and sleep on a condition variable after that.
 * A stage_when job waiting for its flags holds the pool (pool_hold): the workers poll meanwhile,
 * so its parts start at once instead of after the wakeups. One job runs at a time (caller_lock). */

#define MAX_THREADS 64
#define SPIN_NS 50000

typedef void part_fn(void *context, int part);

typedef struct {
    part_fn *run;
    void *context;
} pool_job;

static struct {
    pthread_mutex_t caller_lock, lock;
    pthread_cond_t wake;
    int workers;
    _Atomic uint64_t ticket; /* generation << 32 | parts << 16 | next part */
    _Atomic int done_parts;
    _Atomic int held;        /* stage_when jobs about to run parts: workers poll, never sleep */
    pool_job jobs[2];        /* by generation parity: a late worker never sees the next job's */
} pool = {.caller_lock = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static uint64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

/* Run parts of generation `generation` while there are unclaimed ones. */
static void take_parts(uint64_t generation)
{
    uint64_t ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    while ((ticket >> 32) == generation && (ticket & 0xffff) < ((ticket >> 16) & 0xffff)) {
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &ticket, ticket + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* The job cannot finish, nor its slot be reused, before this claimed part is done. */
        pool_job *job = &pool.jobs[generation & 1];
        job->run(job->context, (int)(ticket & 0xffff));
        atomic_fetch_add_explicit(&pool.done_parts, 1, memory_order_release);
        ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
}

static void *pool_worker(void *unused)
{
    (void)unused;
    uint64_t seen = atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32;
    for (;;) {
        uint64_t began = monotonic_ns(), generation;
        unsigned spins = 0;
        while ((generation = atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32) == seen) {
            cpu_relax();
            if (++spins % 64 != 0)
                continue;
            if (atomic_load_explicit(&pool.held, memory_order_relaxed) > 0) {
                began = monotonic_ns();
                continue;
            }
            if (monotonic_ns() - began <= SPIN_NS)
                continue;
            pthread_mutex_lock(&pool.lock);
            while ((generation = atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32) == seen
                   && atomic_load_explicit(&pool.held, memory_order_relaxed) == 0)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
            began = monotonic_ns();
        }
        seen = generation;
        take_parts(generation);
    }
    return NULL;
}

/* Keep the workers polling (delta 1) or let them sleep again (delta -1). */
static void pool_hold(int delta)
{
    atomic_fetch_add_explicit(&pool.held, delta, memory_order_relaxed);
    if (delta > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
}

/* After fork only the forking thread exists: the child starts its own workers when it needs them. */
static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.caller_lock, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = 0;
    atomic_store_explicit(&pool.held, 0, memory_order_relaxed);
}

/* Run run(context, part) for parts 0..parts-1 on this thread and up to parts - 1 workers; returns
 * when all are done. Called without the GIL. */
static void run_parts(part_fn *run, void *context, int parts)
{
    if (parts <= 1) {
        run(context, 0);
        return;
    }
    pthread_mutex_lock(&pool.caller_lock);
    while (pool.workers < parts - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, pool_worker, NULL);
        pthread_attr_destroy(&attributes);
        if (failed)
            break; /* fewer workers: this thread takes the parts left */
        pool.workers++;
    }
    uint64_t generation = (atomic_load_explicit(&pool.ticket, memory_order_relaxed) >> 32) + 1;
    pool.jobs[generation & 1] = (pool_job){run, context};
    atomic_store_explicit(&pool.done_parts, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.ticket, (generation << 32) | ((uint64_t)parts << 16), memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_parts(generation);
    while (atomic_load_explicit(&pool.done_parts, memory_order_acquire) < parts)
        cpu_relax();
    pthread_mutex_unlock(&pool.caller_lock);
}

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

static void part_bounds(const stage_request *request, int part, Py_ssize_t *low, Py_ssize_t *high)
{
    *low = request->count * part / request->parts;
    *high = request->count * (part + 1) / request->parts;
}

static void split_part(void *context, int part)
{
    stage_request *request = context;
    Py_ssize_t low, high, bad, disk = 0;
    part_bounds(request, part, &low, &high);
    find_slots(request->id + low, high - low, request->first_row, request->num_rows, request->rank_words,
               request->slot_by_rank, request->num_placed, request->slots + low, &bad);
    request->bad[part] = bad < 0 ? -1 : low + bad;
    if (bad >= 0)
        return;
    const int64_t *slot = request->slots;
    int64_t resident = request->num_resident;
    for (Py_ssize_t i = low; i < high; i++) {
        if (slot[i] < resident)
            store_index_uncached(&request->index[i], (int32_t)slot[i]);
        else
            disk++;
    }
    stores_done();
    request->disk[part] = disk;
}

static inline const char *row_at(const stage_request *request, int64_t slot)
{
    return row_address(request->data, slot, request->page_size, request->rows_per_page, request->row_bytes);
}

static void copy_part(void *context, int part)
{
    stage_request *request = context;
    Py_ssize_t low, high, next = request->first[part], row_bytes = request->row_bytes;
    part_bounds(request, part, &low, &high);
    const int64_t *slot = request->slots;
    int64_t resident = request->num_resident;
    for (Py_ssize_t i = low; i < high; i++) {
        if (i + PREFETCH_AHEAD < high && slot[i + PREFETCH_AHEAD] >= resident)
            prefetch_row(row_at(request, slot[i + PREFETCH_AHEAD]), row_bytes);
        if (slot[i] < resident)
            continue;
        store_row_uncached(request->out + next * row_bytes, row_at(request, slot[i]), row_bytes);
        store_index_uncached(&request->index[i], (int32_t)(resident + next));
        next++;
    }
    stores_done();
}

/* Whether the memory pages holding the first byte of `probes` disk rows spread over the request
 * are in the page cache (mincore). */
static int disk_rows_cached(const stage_request *request, Py_ssize_t probes)
{
    Py_ssize_t count = request->count;
    for (Py_ssize_t k = 0; k < probes; k++) {
        Py_ssize_t i = probes > 1 ? (count - 1) * k / (probes - 1) : 0;
        while (i < count && request->slots[i] < request->num_resident)
            i++;
        if (i < count && !page_cached(row_at(request, request->slots[i])))
            return 0;
    }
    return 1;
}

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

static stage_call *new_stage_call(PyObject *args)
{
    PyObject *ids_object, *rank_words_object, *sorted_slots_object, *slots_object, *index_object,
        *mapping_object, *out_object;
    long long first_row, num_rows, num_resident;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots, probes, threads;
    if (!PyArg_ParseTuple(args, "OLLOOLOOOOnnnnnnn", &ids_object, &first_row, &num_rows, &rank_words_object,
                          &sorted_slots_object, &num_resident, &slots_object, &index_object,
                          &mapping_object, &out_object, &data_offset, &page_size, &rows_per_page, &row_bytes,
                          &num_slots, &probes, &threads))
        return NULL;
    if (check_geometry(data_offset, page_size, rows_per_page, row_bytes, num_slots) != 0)
        return NULL;
    if (num_rows < 0 || num_rows > num_slots || num_resident < 0 || probes < 1) {
        PyErr_SetString(PyExc_ValueError, "stage: bad row counts");
        return NULL;
    }
    stage_call *call = PyMem_RawCalloc(1, sizeof(stage_call));
    if (!call) {
        PyErr_NoMemory();
        return NULL;
    }
    held_buffers *held = &call->held;
    Py_buffer *ids, *rank_words, *sorted_slots, *slots, *index, *mapping, *out;
    if (!(ids = hold(held, ids_object, 0, sizeof(int64_t), "ids"))
        || !(rank_words = hold(held, rank_words_object, 0, sizeof(uint64_t), "rank_words"))
        || !(sorted_slots = hold(held, sorted_slots_object, 0, sizeof(uint32_t), "sorted_slots"))
        || !(slots = hold(held, slots_object, 1, sizeof(int64_t), "slots"))
        || !(index = hold(held, index_object, 1, sizeof(int32_t), "index"))
        || !(mapping = hold(held, mapping_object, 0, 1, "mapping"))
        || !(out = hold(held, out_object, 1, 1, "out")))
        goto refused;
    if (out->ndim != 2 || out->shape[1] != row_bytes) {
        PyErr_Format(PyExc_ValueError, "out must be rows of %zd bytes", row_bytes);
        goto refused;
    }
    Py_ssize_t count = ids->len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t num_words = rank_words->len / (Py_ssize_t)(2 * sizeof(uint64_t));
    Py_ssize_t num_pages = (num_slots + rows_per_page - 1) / rows_per_page;
    stage_request *request = &call->request;
    *request = (stage_request){
        .id = ids->buf, .count = count, .first_row = first_row, .num_rows = num_rows,
        .num_placed = sorted_slots->len / (Py_ssize_t)sizeof(uint32_t), .num_resident = num_resident,
        .rank_words = rank_words->buf, .slot_by_rank = sorted_slots->buf,
        .data = (const char *)mapping->buf + data_offset, .page_size = page_size,
        .rows_per_page = rows_per_page, .row_bytes = row_bytes, .out = out->buf, .slots = slots->buf,
        .index = index->buf};
    call->out_rows = out->len / row_bytes;
    call->probes = probes;
    call->first_row = first_row;
    call->num_rows = num_rows;
    const char *mismatch = slots->len != ids->len ? "slots must be as long as ids"
        : index->len / (Py_ssize_t)sizeof(int32_t) != count ? "index must be as long as ids"
        : rank_words->len % (Py_ssize_t)(2 * sizeof(uint64_t)) || (request->num_placed && num_words * 64 < num_rows)
            ? "stage: the rank index does not cover the table"
        : num_resident + call->out_rows > INT32_MAX ? "stage: tier rows past int32"
        : data_offset + num_pages * page_size > mapping->len ? "stage: the mapping is shorter than its pages" : NULL;
    if (mismatch) {
        PyErr_SetString(PyExc_ValueError, mismatch);
        goto refused;
    }
    /* Parts of at least PREFETCH_AHEAD ids, so the prefetch of each runs ahead of its copies. */
    Py_ssize_t parts = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (parts > count / PREFETCH_AHEAD)
        parts = count / PREFETCH_AHEAD > 0 ? count / PREFETCH_AHEAD : 1;
    request->parts = (int)parts;
    return call;
refused:
    release(held);
    PyMem_RawFree(call);
    return NULL;
}

/* The stage itself; runs without the GIL. */
static void run_stage(stage_call *call)
{
    stage_request *request = &call->request;
    Py_ssize_t bad = -1, disk = 0;
    run_parts(split_part, request, request->parts);
    for (int part = 0; part < request->parts && bad < 0; part++) {
        bad = request->bad[part];
        disk += request->disk[part];
    }
    call->staged = 0;
    if (bad < 0 && disk <= call->out_rows && (disk == 0 || disk_rows_cached(request, call->probes))) {
        Py_ssize_t next = call->out_rows - disk;
        for (int part = 0; part < request->parts; part++) {
            request->first[part] = next;
            next += request->disk[part];
        }
        if (disk)
            run_parts(copy_part, request, request->parts);
        call->staged = 1;
    }
    call->bad = bad;
    call->disk = disk;
}

/* (disk, staged) of a run stage, or NULL with its error; the call's buffers are released. */
static PyObject *finish_stage(stage_call *call)
{
    PyObject *result = NULL;
    if (call->bad >= 0)
        refuse_row_id(call->request.id[call->bad], call->first_row, call->num_rows);
    else if (call->disk > call->out_rows)
        PyErr_Format(PyExc_ValueError, "out holds %zd rows, fewer than the %zd disk positions", call->out_rows,
                     call->disk);
    else
        result = Py_BuildValue("nO", call->disk, call->staged ? Py_True : Py_False);
    release(&call->held);
    PyMem_RawFree(call);
    return result;
}

static PyObject *stage(PyObject *self, PyObject *args)
{
    stage_call *call = new_stage_call(args);
    if (!call)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    run_stage(call);
    Py_END_ALLOW_THREADS
    return finish_stage(call);
}

/* --- stage_when: the same stage, run on a thread of its own once a device is done with two
 * things, each signalled by a value it writes into pinned host memory: flags[0] = ids_value after
 * it copied the ids there (the same stream, so in that order), flags[1] = free_value after its
 * last read of `out` (the previous request's rows; free_value < 0: the caller knows that read is
 * done, nothing to wait for). The thread polls the flags, holding the pool's workers awake, for
 * HOLD_NS (a device usually copies the ids within tens of microseconds), then lets them sleep and
 * polls WAIT_SLEEP_NS apart, so the lookup runs while the caller goes on launching work. With a
 * device copy (below) it then queues the staged rows' copy to the device itself. stage_joined
 * waits for the thread and returns what stage returns and whether it copied. A job dropped
 * unjoined (its start abandoned) is cancelled: its thread stops waiting and stages nothing. */

#define HOLD_NS 1000000
#define WAIT_SLEEP_NS 20000

/* --- The copy of a staged request to a GPU, queued by the job's own thread through the CUDA
 * driver (libcuda, opened at the first device_context call): the moment the rows are staged,
 * without waking the Python thread that joins the job (a copy launched from Python costs that
 * thread 40-150 us on the H200's host, BENCHMARKS.md). The job copies the bytes from the first
 * staged row of `out` to the end of the request's `index` entries, which the caller lays out in one
 * pinned span (runtime/torch.py), to the same offsets from `address`, on `stream`, after `wait_event`,
 * then records `done_event`. The thread sets relaxed capture mode so that another thread's CUDA
 * graph capture neither refuses these calls nor is broken by them. */

typedef int cuda_result; /* CUresult: 0 is success */

static struct {
    int loaded;
    cuda_result (*init)(unsigned);
    cuda_result (*device_get)(int *, int);
    cuda_result (*primary_context_retain)(void **, int);
    cuda_result (*get_context)(void **);
    cuda_result (*set_context)(void *);
    cuda_result (*exchange_capture_mode)(int *);
    cuda_result (*stream_wait_event)(void *, void *, unsigned);
    cuda_result (*copy_to_device)(unsigned long long, const void *, size_t, void *);
    cuda_result (*copy_to_host)(void *, unsigned long long, size_t, void *);
    cuda_result (*event_record)(void *, void *);
    cuda_result (*event_synchronize)(void *);
    cuda_result (*graph_launch)(void *, void *);
} cuda;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;

#define CUDA_CAPTURE_MODE_RELAXED 2

static void load_cuda(void)
{
    void *library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!library)
        return;
    struct {
        void **function;
        const char *name;
    } symbols[] = {
        {(void **)&cuda.init, "cuInit"},
        {(void **)&cuda.device_get, "cuDeviceGet"},
        {(void **)&cuda.primary_context_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cuda.get_context, "cuCtxGetCurrent"},
        {(void **)&cuda.set_context, "cuCtxSetCurrent"},
        {(void **)&cuda.exchange_capture_mode, "cuThreadExchangeStreamCaptureMode"},
        {(void **)&cuda.stream_wait_event, "cuStreamWaitEvent"},
        {(void **)&cuda.copy_to_device, "cuMemcpyHtoDAsync_v2"},
        {(void **)&cuda.copy_to_host, "cuMemcpyDtoHAsync_v2"},
        {(void **)&cuda.event_record, "cuEventRecord"},
        {(void **)&cuda.event_synchronize, "cuEventSynchronize"},
        {(void **)&cuda.graph_launch, "cuGraphLaunch"},
    };
    for (size_t k = 0; k < sizeof(symbols) / sizeof(symbols[0]); k++)
        if (!(*symbols[k].function = dlsym(library, symbols[k].name)))
            return;
    cuda.loaded = 1;
}

typedef struct {
    void *context, *stream, *wait_event, *done_event;
    unsigned long long address;  /* 0: no copy asked for */
    cuda_result result;
} device_copy;

static void copy_staged(const stage_call *call, device_copy *copy)
{
    const stage_request *request = &call->request;
    const char *span = request->out;
    size_t low = (size_t)(call->out_rows - call->disk) * (size_t)request->row_bytes;
    size_t high = (size_t)((const char *)(request->index + request->count) - span);
    int mode = CUDA_CAPTURE_MODE_RELAXED;
    cuda_result result = cuda.set_context(copy->context);
    if (result == 0)
        result = cuda.exchange_capture_mode(&mode);
    if (result == 0)
        result = cuda.stream_wait_event(copy->stream, copy->wait_event, 0);
    if (result == 0)
        result = cuda.copy_to_device(copy->address + low, span + low, high - low, copy->stream);
    if (result == 0)
        result = cuda.event_record(copy->done_event, copy->stream);
    copy->result = result;
}

/* 0 once the CUDA driver is loaded, else -1 with an OSError set. */
static int cuda_ready(void)
{
    pthread_once(&cuda_once, load_cuda);
    if (cuda.loaded)
        return 0;
    PyErr_SetString(PyExc_OSError, "the CUDA driver (libcuda.so.1) cannot be loaded");
    return -1;
}

/* The primary context of device `ordinal` (the one torch uses), retained, as an int. */
static PyObject *device_context(PyObject *self, PyObject *args)
{
    int ordinal, device;
    if (!PyArg_ParseTuple(args, "i", &ordinal) || cuda_ready() != 0)
        return NULL;
    void *context = NULL;
    cuda_result result = cuda.init(0);
    if (result == 0)
        result = cuda.device_get(&device, ordinal);
    if (result == 0)
        result = cuda.primary_context_retain(&context, device);
    if (result != 0) {
        PyErr_Format(PyExc_RuntimeError, "CUDA error %d opening device %d's context", result, ordinal);
        return NULL;
    }
    return PyLong_FromVoidPtr(context);
}

static int parse_pointer(PyObject *object, void *pointer)
{
    *(void **)pointer = PyLong_AsVoidPtr(object);
    return !PyErr_Occurred();
}

/* Make `context` current on this thread for a few driver calls; *previous gets the caller's, which
 * leave_context restores. */
static cuda_result enter_context(void *context, void **previous)
{
    cuda_result result = cuda.get_context(previous);
    if (result == 0 && *previous != context)
        result = cuda.set_context(context);
    return result;
}

static void leave_context(void *context, void *previous)
{
    if (previous != context)
        cuda.set_context(previous);
}

/* queue_ids_copy(context, stream, event, target, source, bytes, flag, flag_source): on `stream`,
 * the copy of `bytes` from device address `source` into pinned `target`, then (flag_source not 0)
 * of the 4 bytes at device address `flag_source` into pinned `flag`, then a record of `event`.
 * A start's ids copy in three driver calls, each a fraction of a torch call's cost on the H200's
 * host (runtime/torch.py). `context` is made current for them and the caller's restored. */
static PyObject *queue_ids_copy(PyObject *self, PyObject *args)
{
    void *context, *stream, *event, *target, *flag;
    unsigned long long source, flag_source;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "O&O&O&O&KnO&K", parse_pointer, &context, parse_pointer, &stream, parse_pointer,
                          &event, parse_pointer, &target, &source, &bytes, parse_pointer, &flag, &flag_source))
        return NULL;
    if (bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "queue_ids_copy: bytes < 0");
        return NULL;
    }
    if (cuda_ready() != 0)
        return NULL;
    void *previous = NULL;
    cuda_result result = enter_context(context, &previous);
    if (result == 0)
        result = cuda.copy_to_host(target, source, (size_t)bytes, stream);
    if (result == 0 && flag_source)
        result = cuda.copy_to_host(flag, flag_source, sizeof(int32_t), stream);
    if (result == 0)
        result = cuda.event_record(event, stream);
    leave_context(context, previous);
    if (result != 0)
        return PyErr_Format(PyExc_RuntimeError, "queueing the ids' copy failed (CUDA error %d)", result);
    Py_RETURN_NONE;
}

/* stage_and_launch(context, events, graph, stream, *the arguments of stage): once each CUDA event
 * of `events` (a tuple of handles) has completed, `stage`; then, if the rows were staged and `graph`
 * (a CUDA graph exec) is not 0, the graph's launch on `stream`. A small start from device ids is
 * finished in this one call (runtime/torch.py): the wait for its ids and for the span's last copy,
 * its lookup, and the graph that copies its rows and decodes them, where each CUDA call through
 * torch costs the H200's host 5-10 us and a driver call 0.5-3 us (BENCHMARKS.md). `context` is
 * made current for it and the caller's restored. */
#define MAX_WAIT_EVENTS 4

static PyObject *stage_and_launch(PyObject *self, PyObject *args)
{
    if (PyTuple_GET_SIZE(args) < 4) {
        PyErr_SetString(PyExc_TypeError, "stage_and_launch(context, events, graph, stream, *stage arguments)");
        return NULL;
    }
    void *context, *graph, *stream, *events[MAX_WAIT_EVENTS];
    PyObject *event_handles = PyTuple_GET_ITEM(args, 1);
    if (!parse_pointer(PyTuple_GET_ITEM(args, 0), &context) || !parse_pointer(PyTuple_GET_ITEM(args, 2), &graph)
        || !parse_pointer(PyTuple_GET_ITEM(args, 3), &stream))
        return NULL;
    if (!PyTuple_Check(event_handles) || PyTuple_GET_SIZE(event_handles) > MAX_WAIT_EVENTS) {
        PyErr_Format(PyExc_ValueError, "stage_and_launch: events must be a tuple of at most %d handles",
                     MAX_WAIT_EVENTS);
        return NULL;
    }
    Py_ssize_t num_events = PyTuple_GET_SIZE(event_handles);
    for (Py_ssize_t k = 0; k < num_events; k++)
        if (!parse_pointer(PyTuple_GET_ITEM(event_handles, k), &events[k]))
            return NULL;
    if (cuda_ready() != 0)
        return NULL;
    PyObject *stage_args = PyTuple_GetSlice(args, 4, PyTuple_GET_SIZE(args));
    if (!stage_args)
        return NULL;
    stage_call *call = new_stage_call(stage_args);
    Py_DECREF(stage_args);
    if (!call)
        return NULL;
    int launched = 0;
    cuda_result result;
    Py_BEGIN_ALLOW_THREADS
    void *previous = NULL;
    result = enter_context(context, &previous);
    for (Py_ssize_t k = 0; k < num_events && result == 0; k++)
        result = cuda.event_synchronize(events[k]);
    if (result == 0) {
        run_stage(call);
        if (call->staged && graph) {
            result = cuda.graph_launch(graph, stream);
            launched = result == 0;
        }
    }
    leave_context(context, previous);
    Py_END_ALLOW_THREADS
    if (result != 0) {
        release(&call->held);
        PyMem_RawFree(call);
        return PyErr_Format(PyExc_RuntimeError, "a device-ids lookup's CUDA wait or launch failed (CUDA error %d)",
                            result);
    }
    PyObject *staged = finish_stage(call);
    if (!staged)
        return NULL;
    return Py_BuildValue("NO", staged, launched ? Py_True : Py_False);
}

typedef struct {
    stage_call *call;
    const int32_t *flags;
    int32_t values[2];
    device_copy copy;
    _Atomic int cancelled;
    int joined;
    pthread_t thread;
} stage_job;

static int flags_hold_values(const stage_job *job)
{
    return __atomic_load_n(&job->flags[0], __ATOMIC_ACQUIRE) == job->values[0]
           && (job->values[1] < 0 || __atomic_load_n(&job->flags[1], __ATOMIC_ACQUIRE) == job->values[1]);
}

static void *stage_job_main(void *argument)
{
    stage_job *job = argument;
    uint64_t began = monotonic_ns();
    unsigned spins = 0;
    int holding = job->call->request.parts > 1;
    if (holding)
        pool_hold(1);
    while (!flags_hold_values(job)) {
        if (atomic_load_explicit(&job->cancelled, memory_order_relaxed))
            break;
        if (++spins % 64 != 0 || monotonic_ns() - began < HOLD_NS) {
            cpu_relax();
            continue;
        }
        if (holding)
            pool_hold(-1);
        holding = 0;
        struct timespec pause = {0, WAIT_SLEEP_NS};
        nanosleep(&pause, NULL);
    }
    if (holding)
        pool_hold(-1);
    if (!atomic_load_explicit(&job->cancelled, memory_order_relaxed)) {
        run_stage(job->call);
        if (job->copy.address && job->call->staged)
            copy_staged(job->call, &job->copy);
    }
    return NULL;
}

/* Wait for a job's thread (stopping it first with `cancel`); called with the GIL, released while
 * waiting. Without `cancel`, the caller finishes the call (finish_stage); with it, it is dropped. */
static void join_job(stage_job *job, int cancel)
{
    if (cancel)
        atomic_store_explicit(&job->cancelled, 1, memory_order_relaxed);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(job->thread, NULL);
    Py_END_ALLOW_THREADS
    job->joined = 1;
    if (cancel) {
        release(&job->call->held);
        PyMem_RawFree(job->call);
    }
}

static void stage_job_destroy(PyObject *capsule)
{
    stage_job *job = PyCapsule_GetPointer(capsule, "ple_prep.stage_job");
    if (!job)
        return;
    if (!job->joined)
        join_job(job, 1);
    PyMem_RawFree(job);
}

/* The device_copy of stage_when's `copy` argument: None, or (context, stream, wait_event, done_event,
 * address) as ints; 0 on success, -1 with an exception set. */
static int parse_device_copy(PyObject *object, device_copy *copy)
{
    *copy = (device_copy){0};
    if (object == Py_None)
        return 0;
    if (!PyArg_ParseTuple(object, "O&O&O&O&K;copy must be (context, stream, wait_event, done_event, address)",
                          parse_pointer, &copy->context, parse_pointer, &copy->stream, parse_pointer,
                          &copy->wait_event, parse_pointer, &copy->done_event, &copy->address))
        return -1;
    if (cuda_ready() != 0)
        return -1;
    if (!copy->address) {
        PyErr_SetString(PyExc_ValueError, "stage_when: a device copy needs a device address");
        return -1;
    }
    return 0;
}

static PyObject *stage_when(PyObject *self, PyObject *args)
{
    if (PyTuple_GET_SIZE(args) < 4) {
        PyErr_SetString(PyExc_TypeError, "stage_when(flags, ids_value, free_value, copy, *stage arguments)");
        return NULL;
    }
    long values[2];
    for (int k = 0; k < 2; k++) {
        values[k] = PyLong_AsLong(PyTuple_GET_ITEM(args, 1 + k));
        if (values[k] == -1 && PyErr_Occurred())
            return NULL;
    }
    device_copy copy;
    if (parse_device_copy(PyTuple_GET_ITEM(args, 3), &copy) != 0)
        return NULL;
    Py_buffer flag;
    if (get_buffer(PyTuple_GET_ITEM(args, 0), &flag, 0, sizeof(int32_t), "flags") != 0)
        return NULL;
    if (flag.len != 2 * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "flags must be two int32");
        PyBuffer_Release(&flag);
        return NULL;
    }
    PyObject *stage_args = PyTuple_GetSlice(args, 4, PyTuple_GET_SIZE(args));
    if (!stage_args) {
        PyBuffer_Release(&flag);
        return NULL;
    }
    stage_call *call = new_stage_call(stage_args);
    Py_DECREF(stage_args);
    if (call && copy.address
        && (const char *)call->request.index < call->request.out + call->out_rows * call->request.row_bytes) {
        /* copy_staged copies from the staged rows up to the index's end: the index must follow. */
        PyErr_SetString(PyExc_ValueError, "stage_when: a device copy needs index after out in one buffer");
        release(&call->held);
        PyMem_RawFree(call);
        call = NULL;
    }
    stage_job *job = call ? PyMem_RawCalloc(1, sizeof(stage_job)) : NULL;
    PyObject *capsule = NULL;
    if (call && !job)
        PyErr_NoMemory();
    if (job) {
        /* The flags outlive the job: the caller holds their buffer until it joins or drops it. */
        *job = (stage_job){.call = call, .flags = flag.buf, .values = {(int32_t)values[0], (int32_t)values[1]},
                           .copy = copy};
        if (pthread_create(&job->thread, NULL, stage_job_main, job) != 0)
            PyErr_SetString(PyExc_OSError, "stage_when: cannot start a thread");
        else if (!(capsule = PyCapsule_New(job, "ple_prep.stage_job", stage_job_destroy))) {
            atomic_store_explicit(&job->cancelled, 1, memory_order_relaxed);
            pthread_join(job->thread, NULL);
        }
    }
    if (!capsule && call) {
        release(&call->held);
        PyMem_RawFree(call);
        PyMem_RawFree(job);
    }
    PyBuffer_Release(&flag);
    return capsule;
}

static PyObject *stage_joined(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    int cancel = 0;
    if (!PyArg_ParseTuple(args, "O|p", &capsule, &cancel))
        return NULL;
    stage_job *job = PyCapsule_GetPointer(capsule, "ple_prep.stage_job");
    if (!job)
        return NULL;
    if (job->joined) {
        PyErr_SetString(PyExc_RuntimeError, "stage_joined: this job was joined already");
        return NULL;
    }
    join_job(job, cancel);
    if (cancel)
        Py_RETURN_NONE;
    /* The thread queues the copy exactly when asked and the rows were staged (copy_staged). */
    int copied = job->copy.address && job->call->staged;
    if (job->copy.result != 0) {
        release(&job->call->held);
        PyMem_RawFree(job->call);
        return PyErr_Format(PyExc_RuntimeError, "the copy of the staged rows to the device failed (CUDA error %d)",
                            job->copy.result);
    }
    PyObject *staged = finish_stage(job->call);
    if (!staged)
        return NULL;
    PyObject *result = Py_BuildValue("OO", staged, copied ? Py_True : Py_False);
    Py_DECREF(staged);
    return result;
}

static PyObject *cached(PyObject *self, PyObject *args)
{
    PyObject *mapping_object, *slots_object;
    Py_ssize_t data_offset, page_size, rows_per_page, row_bytes, num_slots, probes;
    if (!PyArg_ParseTuple(args, "OOnnnnnn", &mapping_object, &slots_object, &data_offset, &page_size,
                          &rows_per_page, &row_bytes, &num_slots, &probes)
        || check_geometry(data_offset, page_size, rows_per_page, row_bytes, num_slots) != 0)
        return NULL;
    if (probes < 2) {
        PyErr_SetString(PyExc_ValueError, "cached: probes must be >= 2");
        return NULL;
    }
    held_buffers held = {.held = 0};
    Py_buffer *mapping, *slots;
    if (!(mapping = hold(&held, mapping_object, 0, 1, "mapping"))
        || !(slots = hold(&held, slots_object, 0, sizeof(int64_t), "slots"))) {
        release(&held);
        return NULL;
    }
    Py_ssize_t count = slots->len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *slot = (const int64_t *)slots->buf;
    const char *data = (const char *)mapping->buf + data_offset;
    int resident = 1;
    for (Py_ssize_t k = 0; k < probes && count && resident; k++) {
        int64_t s = slot[(count - 1) * k / (probes - 1)];
        if ((uint64_t)s >= (uint64_t)num_slots
            || data_offset + (s / rows_per_page) * page_size + (s % rows_per_page) * row_bytes >= mapping->len)
            continue;  /* left to copy_rows to refuse */
        resident = page_cached(row_address(data, s, page_size, rows_per_page, row_bytes));
    }
    release(&held);
    return PyBool_FromLong(resident);
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS, "Rows at file slots into out (see the module's comment)."},
    {"slot_of", slot_of, METH_VARARGS, "File slots of row ids from the rank index."},
    {"stage", stage, METH_VARARGS, "A request's slots and tier rows, and its cached disk rows staged."},
    {"stage_when", stage_when, METH_VARARGS, "stage on a thread of its own once two flags hold values."},
    {"stage_joined", stage_joined, METH_VARARGS,
     "Wait for (or cancel) a stage_when job: (what stage returns, whether it copied to the device)."},
    {"device_context", device_context, METH_VARARGS, "The CUDA primary context of a device, for stage_when."},
    {"queue_ids_copy", queue_ids_copy, METH_VARARGS, "A start's ids copy to pinned memory, its flag and event."},
    {"stage_and_launch", stage_and_launch, METH_VARARGS,
     "stage after CUDA events, then a CUDA graph's launch: ((disk, staged), launched)."},
    {"cached", cached, METH_VARARGS, "Whether a few rows spread over a request are in the page cache."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    pthread_atfork(NULL, NULL, pool_after_fork);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("popcnt"))
        find_slots = find_slots_popcnt;
#endif
    return PyModule_Create(&module);
}
