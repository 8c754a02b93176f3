#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "../../core/native/guard.h"
#include "../../core/native/rows.h"
#include "stage.h"
#include "view.h"

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

int page_cached(const char *address)
{
    uintptr_t system_page = (uintptr_t)sysconf(_SC_PAGESIZE), at = (uintptr_t)address;
    unsigned char state = 0;
    int result;
    /* EAGAIN: the kernel was short of memory for a moment; try again. */
    while ((result = mincore((void *)(at - at % system_page), 1, &state)) != 0 && errno == EAGAIN)
        ;
    return result != 0 ? -1 : (state & 1);
}

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
               request->packed_slots, request->num_placed, request->slots + low, &bad);
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
    Py_ssize_t stop = next + request->disk[part];
    part_bounds(request, part, &low, &high);
    /* Each slot read once and checked: the caller owns the buffer and may write it meanwhile. */
    const volatile int64_t *slot = request->slots;
    int64_t resident = request->num_resident, num_slots = request->num_slots;
    fault_guard guard;
    if (sigsetjmp(guard.jump, 0) != 0) {
        request->fault[part] = guard.address;
        request->faulted[part] = 1;
        stores_done();
        return;
    }
    current_guard = &guard;
    for (Py_ssize_t i = low; i < high; i++) {
        if (i + PREFETCH_AHEAD < high) {
            int64_t ahead = slot[i + PREFETCH_AHEAD];
            if (ahead >= resident && ahead < num_slots)
                prefetch_row(row_at(request, ahead), row_bytes);
        }
        int64_t s = slot[i];
        if (s < resident)
            continue;
        if (s >= num_slots || next >= stop) {
            request->raced[part] = 1;
            break;
        }
        store_row_uncached(request->out + next * row_bytes, row_at(request, s), row_bytes);
        store_index_uncached(&request->index[i], (int32_t)(resident + next));
        next++;
    }
    current_guard = NULL;
    stores_done();
}

/* Whether the memory pages holding the first byte of `probes` disk rows spread over the request
 * are in the page cache (mincore); -1 with errno set when mincore fails. */
static int disk_rows_cached(const stage_request *request, Py_ssize_t probes)
{
    Py_ssize_t count = request->count;
    for (Py_ssize_t k = 0; k < probes; k++) {
        Py_ssize_t i = probes > 1 ? (count - 1) * k / (probes - 1) : 0;
        int64_t s = -1;
        while (i < count && (s = request->slots[i]) < request->num_resident)
            i++;
        if (i >= count)
            continue;
        if (s >= request->num_slots)
            return 0; /* changed by the caller: copy_part refuses it */
        int cached = page_cached(row_at(request, s));
        if (cached != 1)
            return cached;
    }
    return 1;
}

stage_call *new_stage_call(PyObject *args)
{
    PyObject *view_object, *ids_object, *slots_object, *index_object, *out_object;
    long long num_resident;
    Py_ssize_t probes, threads;
    if (!PyArg_ParseTuple(args, "OOLOOOnn", &view_object, &ids_object, &num_resident, &slots_object, &index_object,
                          &out_object, &probes, &threads))
        return NULL;
    table_view *view = as_table_view(view_object);
    if (!view)
        return NULL;
    if (num_resident < 0 || probes < 1) {
        PyErr_SetString(PyExc_ValueError, "stage: bad row counts");
        return NULL;
    }
    stage_call *call = PyMem_RawCalloc(1, sizeof(stage_call));
    if (!call) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_INCREF(view_object);
    call->view = view_object;
    held_buffers *held = &call->held;
    Py_buffer *ids, *slots, *index, *out;
    if (!(ids = hold(held, ids_object, 0, sizeof(int64_t), "ids"))
        || !(slots = hold(held, slots_object, 1, sizeof(int64_t), "slots"))
        || !(index = hold(held, index_object, 1, sizeof(int32_t), "index"))
        || !(out = hold(held, out_object, 1, 1, "out")))
        goto refused;
    Py_ssize_t row_bytes = view->row_bytes;
    if (out->ndim != 2 || out->shape[1] != row_bytes) {
        PyErr_Format(PyExc_ValueError, "out must be rows of %zd bytes", row_bytes);
        goto refused;
    }
    Py_ssize_t count = ids->len / (Py_ssize_t)sizeof(int64_t);
    stage_request *request = &call->request;
    *request = (stage_request){
        .id = ids->buf, .count = count, .first_row = view->first_row, .num_rows = view->num_rows,
        .num_placed = view->num_placed, .num_resident = num_resident, .rank_words = view->rank_words,
        .packed_slots = view->packed_slots, .data = view->data, .mapping = view->mapping,
        .page_size = view->page_size, .rows_per_page = view->rows_per_page, .row_bytes = row_bytes,
        .num_slots = view->num_slots, .out = out->buf, .slots = slots->buf, .index = index->buf};
    call->out_rows = out->len / row_bytes;
    call->probes = probes;
    call->first_row = view->first_row;
    call->num_rows = view->num_rows;
    const char *mismatch = slots->len != ids->len ? "slots must be as long as ids"
        : index->len / (Py_ssize_t)sizeof(int32_t) != count ? "index must be as long as ids"
        : num_resident + call->out_rows > INT32_MAX ? "stage: tier rows past int32" : NULL;
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
    free_stage_call(call);
    return NULL;
}

void free_stage_call(stage_call *call)
{
    release(&call->held);
    Py_XDECREF(call->view);
    PyMem_RawFree(call);
}

void run_stage(stage_call *call)
{
    stage_request *request = &call->request;
    Py_ssize_t bad = -1, disk = 0;
    /* A call is run again for every step of the step service (steps.c): no step's fault or race
     * may be taken for the next one's. */
    for (int part = 0; part < MAX_THREADS; part++)
        request->faulted[part] = request->raced[part] = 0;
    run_parts(split_part, request, request->parts);
    for (int part = 0; part < request->parts && bad < 0; part++) {
        bad = request->bad[part];
        disk += request->disk[part];
    }
    call->staged = 0;
    call->probe_error = 0;
    int cached = bad < 0 && disk <= call->out_rows && disk ? disk_rows_cached(request, call->probes) : 1;
    if (cached < 0)
        call->probe_error = errno ? errno : EIO;
    if (bad < 0 && disk <= call->out_rows && cached == 1) {
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

PyObject *finish_stage(stage_call *call)
{
    PyObject *result = NULL;
    const stage_request *request = &call->request;
    int part = 0;
    while (part < request->parts && !request->faulted[part] && !request->raced[part])
        part++;
    if (call->staged && part < request->parts && request->faulted[part])
        refuse_fault(request->mapping, request->fault[part]);
    else if (call->staged && part < request->parts)
        PyErr_SetString(PyExc_RuntimeError, "stage: the slots buffer changed while the rows were copied "
                        "(another thread wrote it); nothing was staged");
    else if (call->probe_error)
        set_os_error(call->probe_error, PyUnicode_FromFormat("mincore failed on the table's mapping (%s)",
                                                             strerror(call->probe_error)));
    else if (call->bad >= 0)
        refuse_row_id(call->request.id[call->bad], call->first_row, call->num_rows);
    else if (call->disk > call->out_rows)
        PyErr_Format(PyExc_ValueError, "out holds %zd rows, fewer than the %zd disk positions", call->out_rows,
                     call->disk);
    else
        result = Py_BuildValue("nO", call->disk, call->staged ? Py_True : Py_False);
    free_stage_call(call);
    return result;
}
