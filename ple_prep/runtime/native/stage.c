#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "../../core/native/rows.h"
#include "stage.h"

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
    return mincore((void *)(at - at % system_page), 1, &state) == 0 && (state & 1);
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

stage_call *new_stage_call(PyObject *args)
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

void run_stage(stage_call *call)
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

PyObject *finish_stage(stage_call *call)
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
