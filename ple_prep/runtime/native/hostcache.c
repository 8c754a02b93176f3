/* The host cache's lookup and admission (ple_prep/runtime/hostcache.py); functions of
 * ple_prep.runtime._native and a C interface for the step service's thread (hostcache.h).
 *
 * The cache is set-associative: slot s lives in set ((h >> 32) * sets) >> 32, h = s * K mod 2**64
 * (hostcache.py computes the same), in one of the set's `ways` entries. An entry is a 64-bit word
 * (the slot + 1 in the low 56 bits, flags in the top byte; 0 when empty, so fresh memory is an
 * empty cache) and the row's bytes, in two arrays hostcache.py allocates; one byte per set holds
 * its clock hand. Keeping the flags in the word means a lookup touches one line of words per set
 * and the row, nothing else.
 *
 * Exactness: every read or write of the words, rows, hands and counts happens under the cache's
 * own mutex, never the GIL: the step service's thread (steps.c) cannot take the GIL (a Python
 * thread holding it while it waits for the device would wait for a step that waits for it), and
 * the Python calls release the GIL while they wait for the mutex and work. So no entry changes
 * while a row is copied out of it, and a row is copied only from an entry whose word names the
 * slot asked for. Every index into the arrays derives from the geometry checked at hostcache_new.
 *
 * Flags: REFERENCED (a hit since the set's clock hand last passed the entry) and PINNED (read ahead
 * and not yet looked up: never evicted). hostcache.py documents the policy.
 */
#include "hostcache.h"

#include <pthread.h>
#include <string.h>

#define SLOT_MASK ((uint64_t)0x00FFFFFFFFFFFFFFull)
#define REFERENCED ((uint64_t)1 << 56)
#define PINNED ((uint64_t)2 << 56)
#define EMPTY ((uint64_t)0)
/* The pipeline of `lookup`: a set's words are fetched this many slots ahead of the slot being
 * copied, its row half as many. */
#define AHEAD 16
#define RING 32
#define CACHE_CAPSULE "ple_prep.host_cache"

struct host_cache {
    Py_buffer words_view, data_view, hands_view; /* held: the arrays live as long as the capsule */
    uint64_t *word;
    uint8_t *rows, *hand;
    int64_t sets, ways, row_bytes, num_slots; /* num_slots: the table's; a lookup refuses others */
    pthread_mutex_t lock;
    int64_t hits, misses, read_ahead_hits, pinned, dropped; /* under lock */
};

static const uint64_t MULTIPLIER = 0x9E3779B97F4A7C15ull;

static inline int64_t set_index(const host_cache *cache, int64_t slot)
{
    return (int64_t)(((((uint64_t)slot * MULTIPLIER) >> 32) * (uint64_t)cache->sets) >> 32);
}

/* The entry holding `slot`, or -1 (for a negative slot too: slot + 1 would be an empty entry's word). */
static inline int64_t find(const host_cache *cache, int64_t slot)
{
    if (slot < 0)
        return -1;
    const uint64_t *word = cache->word;
    int64_t first = set_index(cache, slot) * cache->ways;
    for (int64_t way = 0; way < cache->ways; way++)
        if ((word[first + way] & SLOT_MASK) == (uint64_t)slot + 1)
            return first + way;
    return -1;
}

/* The entry a new row for a slot of `set` takes by the set's clock, or -1 (all pinned). The hand
 * passes pinned entries, clears the referenced mark of the ones it passes, and takes the first
 * with neither: two turns, the first may only clear marks. */
static int64_t victim(host_cache *cache, int64_t set)
{
    int64_t first = set * cache->ways;
    uint8_t *hand = cache->hand + set;
    for (int64_t step = 0; step < 2 * cache->ways; step++) {
        int64_t candidate = first + *hand;
        *hand = (uint8_t)((*hand + 1) % cache->ways);
        uint64_t value = cache->word[candidate];
        if (value == EMPTY)
            return candidate;
        if (value & PINNED)
            continue;
        if (value & REFERENCED) {
            cache->word[candidate] = value & ~REFERENCED;
            continue;
        }
        return candidate;
    }
    return -1;
}

/* Admit one row (locked): 1 added, 0 cached already or dropped; pins with `pin`. */
static int admit_one(host_cache *cache, int64_t slot, const uint8_t *row, int pin)
{
    int64_t entry = find(cache, slot);
    if (entry >= 0) {
        if (pin && !(cache->word[entry] & PINNED)) {
            cache->word[entry] |= PINNED;
            cache->pinned++;
        }
        return 0;
    }
    entry = victim(cache, set_index(cache, slot));
    if (entry < 0) {
        cache->dropped++;
        return 0;
    }
    cache->word[entry] = ((uint64_t)slot + 1) | (pin ? PINNED : 0);
    memcpy(cache->rows + entry * cache->row_bytes, row, (size_t)cache->row_bytes);
    cache->pinned += pin;
    return 1;
}

/* Copy an entry's row out (locked), marking it referenced and taking its pin: 1 if it was pinned. */
static inline int take(host_cache *cache, int64_t entry, uint8_t *target)
{
    memcpy(target, cache->rows + entry * cache->row_bytes, (size_t)cache->row_bytes);
    uint64_t value = cache->word[entry];
    if ((value & ~SLOT_MASK) != REFERENCED)
        cache->word[entry] = (value & SLOT_MASK) | REFERENCED;
    return (value & PINNED) != 0;
}

void host_cache_lock(host_cache *cache)
{
    pthread_mutex_lock(&cache->lock);
}

void host_cache_unlock(host_cache *cache)
{
    pthread_mutex_unlock(&cache->lock);
}

int64_t host_cache_row_bytes(const host_cache *cache)
{
    return cache->row_bytes;
}

int host_cache_copy(host_cache *cache, int64_t slot, char *target, int *was_pinned)
{
    int64_t entry = slot >= 0 && (uint64_t)slot < SLOT_MASK ? find(cache, slot) : -1;
    if (entry < 0) {
        cache->misses++;
        *was_pinned = 0;
        return 0;
    }
    *was_pinned = take(cache, entry, (uint8_t *)target);
    cache->hits++;
    cache->pinned -= *was_pinned;
    cache->read_ahead_hits += *was_pinned;
    return 1;
}

void host_cache_prefetch(const host_cache *cache, int64_t slot)
{
    __builtin_prefetch(cache->word + set_index(cache, slot) * cache->ways);
}

void host_cache_insert(host_cache *cache, int64_t slot, const char *row)
{
    if (slot >= 0 && (uint64_t)slot < SLOT_MASK)
        admit_one(cache, slot, (const uint8_t *)row, 0);
}

int host_cache_holds(host_cache *cache, int64_t slot)
{
    int64_t entry = slot >= 0 && (uint64_t)slot < SLOT_MASK ? find(cache, slot) : -1;
    if (entry >= 0)
        cache->word[entry] |= REFERENCED;
    return entry >= 0;
}

int host_cache_insert_pinned(host_cache *cache, int64_t slot, const char *row)
{
    if (slot < 0 || (uint64_t)slot >= SLOT_MASK || find(cache, slot) >= 0)
        return 0;
    return admit_one(cache, slot, (const uint8_t *)row, 1);
}

int64_t host_cache_pinned(const host_cache *cache)
{
    return cache->pinned;
}

static void release_views(host_cache *cache)
{
    PyBuffer_Release(&cache->words_view);
    PyBuffer_Release(&cache->data_view);
    PyBuffer_Release(&cache->hands_view);
}

static void cache_destroy(PyObject *capsule)
{
    host_cache *cache = PyCapsule_GetPointer(capsule, CACHE_CAPSULE);
    if (!cache)
        return;
    release_views(cache);
    pthread_mutex_destroy(&cache->lock);
    PyMem_RawFree(cache);
}

host_cache *host_cache_of(PyObject *capsule)
{
    return PyCapsule_GetPointer(capsule, CACHE_CAPSULE);
}

/* hostcache_new(words, data, hands, ways, row_bytes, num_slots) -> cache: the arrays' sizes checked
 * against one another and held (never resized) until the cache is collected. */
PyObject *hostcache_new(PyObject *self, PyObject *args)
{
    PyObject *words, *data, *hands;
    Py_ssize_t ways, row_bytes, num_slots;
    if (!PyArg_ParseTuple(args, "OOOnnn", &words, &data, &hands, &ways, &row_bytes, &num_slots))
        return NULL;
    host_cache *cache = PyMem_RawCalloc(1, sizeof(host_cache));
    if (!cache)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(words, &cache->words_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0
        || PyObject_GetBuffer(data, &cache->data_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0
        || PyObject_GetBuffer(hands, &cache->hands_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        release_views(cache);
        PyMem_RawFree(cache);
        return NULL;
    }
    int64_t entries = cache->words_view.len / 8;
    cache->ways = ways;
    cache->row_bytes = row_bytes;
    cache->num_slots = num_slots;
    cache->sets = cache->hands_view.len;
    if (ways < 1 || ways > 255 || row_bytes < 1 || num_slots < 0 || cache->sets < 1 || cache->sets >= ((int64_t)1 << 32)
        || cache->sets * ways != entries || cache->data_view.len != entries * row_bytes) {
        release_views(cache);
        PyMem_RawFree(cache);
        PyErr_SetString(PyExc_ValueError, "host cache arrays disagree on their geometry");
        return NULL;
    }
    cache->word = cache->words_view.buf;
    cache->rows = cache->data_view.buf;
    cache->hand = cache->hands_view.buf;
    pthread_mutex_init(&cache->lock, NULL);
    PyObject *capsule = PyCapsule_New(cache, CACHE_CAPSULE, cache_destroy);
    if (!capsule) {
        release_views(cache);
        pthread_mutex_destroy(&cache->lock);
        PyMem_RawFree(cache);
    }
    return capsule;
}

static int get_slots(PyObject *object, Py_buffer *view, int64_t *count)
{
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    *count = view->len / 8;
    return 0;
}

/* The lookup's loop (locked): the words of slot i + AHEAD are fetched while slot i is looked up
 * and its row fetched, and slot i - AHEAD / 2's row is copied: each row costs a copy, not two
 * trips to memory in turn (the cache is far larger than the CPU's). found[i % RING] is slot i's
 * entry. Returns the misses' count; *unpinned the pins taken. */
static int64_t lookup_locked(host_cache *cache, const int64_t *slot, int64_t count, uint8_t *target,
                             const int64_t *position, int64_t *missed, int64_t *unpinned)
{
    int64_t found[RING], missed_count = 0, row_bytes = cache->row_bytes;
    *unpinned = 0;
    for (int64_t i = 0; i < count + AHEAD / 2; i++) {
        if (i + AHEAD < count)
            __builtin_prefetch(cache->word + set_index(cache, slot[i + AHEAD]) * cache->ways);
        if (i < count) {
            int64_t entry = find(cache, slot[i]);
            found[i % RING] = entry;
            if (entry >= 0)
                for (int64_t line = 0; line < row_bytes; line += 64)
                    __builtin_prefetch(cache->rows + entry * row_bytes + line);
        }
        int64_t j = i - AHEAD / 2;
        if (j < 0)
            continue;
        int64_t entry = found[j % RING];
        if (entry < 0)
            missed[missed_count++] = j;
        else
            *unpinned += take(cache, entry, target + (position ? position[j] : j) * row_bytes);
    }
    cache->hits += count - missed_count;
    cache->misses += missed_count;
    cache->pinned -= *unpinned;
    cache->read_ahead_hits += *unpinned;
    return missed_count;
}

/* lookup(cache, slots, out, positions, misses) -> (missed, unpinned)
 * Each slot found is copied to out[positions[i]] (out[i] without positions) and its entry marked
 * referenced and unpinned; the indexes i of the others go to misses[0:missed]. IndexError for a
 * slot outside the table's, before anything is copied (a loop here costs less than the caller's
 * numpy reductions on a decode step's 16 slots). */
PyObject *hostcache_lookup(PyObject *self, PyObject *args)
{
    PyObject *capsule, *slots_obj, *out_obj, *positions_obj, *misses_obj;
    if (!PyArg_ParseTuple(args, "OOOOO", &capsule, &slots_obj, &out_obj, &positions_obj, &misses_obj))
        return NULL;
    host_cache *cache = host_cache_of(capsule);
    if (!cache)
        return NULL;
    Py_buffer slots = {0}, out = {0}, positions = {0}, misses = {0};
    PyObject *result = NULL;
    int64_t count = 0, row_bytes = cache->row_bytes;
    if (get_slots(slots_obj, &slots, &count) < 0)
        goto done;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (positions_obj != Py_None && PyObject_GetBuffer(positions_obj, &positions, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(misses_obj, &misses, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    int64_t out_rows = out.len / row_bytes;
    if (misses.len / 8 < count || (positions.obj && positions.len / 8 != count) || out.len % row_bytes
        || (!positions.obj && out_rows != count)) {
        PyErr_SetString(PyExc_ValueError, "lookup: slots, out, positions and misses disagree in length");
        goto done;
    }
    const int64_t *position = positions.obj ? positions.buf : NULL, *slot = slots.buf;
    for (int64_t i = 0; i < count; i++) {
        if (position && (position[i] < 0 || position[i] >= out_rows)) {
            PyErr_SetString(PyExc_IndexError, "lookup: a position lies outside out");
            goto done;
        }
        if (slot[i] < 0 || slot[i] >= cache->num_slots) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the table's %lld slots", (long long)slot[i],
                         (long long)cache->num_slots);
            goto done;
        }
    }
    int64_t missed, unpinned;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cache->lock);
    missed = lookup_locked(cache, slots.buf, count, out.buf, position, misses.buf, &unpinned);
    pthread_mutex_unlock(&cache->lock);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("LL", (long long)missed, (long long)unpinned);
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&out);
    PyBuffer_Release(&positions);
    PyBuffer_Release(&misses);
    return result;
}

/* probe(cache, slots, misses) -> missed
 * Read-ahead's check: each slot found is marked referenced (nothing copied, no pin taken); the
 * indexes i of the others go to misses[0:missed]. */
PyObject *hostcache_probe(PyObject *self, PyObject *args)
{
    PyObject *capsule, *slots_obj, *misses_obj;
    if (!PyArg_ParseTuple(args, "OOO", &capsule, &slots_obj, &misses_obj))
        return NULL;
    host_cache *cache = host_cache_of(capsule);
    if (!cache)
        return NULL;
    Py_buffer slots = {0}, misses = {0};
    PyObject *result = NULL;
    int64_t count = 0;
    if (get_slots(slots_obj, &slots, &count) < 0)
        goto done;
    if (PyObject_GetBuffer(misses_obj, &misses, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (misses.len / 8 < count) {
        PyErr_SetString(PyExc_ValueError, "probe: misses is shorter than slots");
        goto done;
    }
    const int64_t *slot = slots.buf;
    int64_t *missed = misses.buf, missed_count = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cache->lock);
    for (int64_t i = 0; i < count; i++) {
        if (i + AHEAD < count)
            __builtin_prefetch(cache->word + set_index(cache, slot[i + AHEAD]) * cache->ways);
        int64_t entry = find(cache, slot[i]);
        if (entry < 0)
            missed[missed_count++] = i;
        else
            cache->word[entry] |= REFERENCED;
    }
    pthread_mutex_unlock(&cache->lock);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(missed_count);
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&misses);
    return result;
}

/* admit(cache, slots, rows, pin) -> (added, pinned, dropped)
 * Each slot not in the cache takes an entry of its set chosen by the set's clock (victim); rows[i]
 * is copied there. With pin, entries (new or found) are pinned. A slot whose set holds only
 * pinned entries is dropped (not admitted). Slots outside [0, 2**56 - 1) are refused. */
PyObject *hostcache_admit(PyObject *self, PyObject *args)
{
    PyObject *capsule, *slots_obj, *rows_obj;
    int pin;
    if (!PyArg_ParseTuple(args, "OOOp", &capsule, &slots_obj, &rows_obj, &pin))
        return NULL;
    host_cache *cache = host_cache_of(capsule);
    if (!cache)
        return NULL;
    Py_buffer slots = {0}, rows = {0};
    PyObject *result = NULL;
    int64_t count = 0, row_bytes = cache->row_bytes;
    if (get_slots(slots_obj, &slots, &count) < 0)
        goto done;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (rows.len != count * row_bytes) {
        PyErr_SetString(PyExc_ValueError, "admit: rows must hold one row per slot");
        goto done;
    }
    const int64_t *slot = slots.buf;
    for (int64_t i = 0; i < count; i++) {
        if (slot[i] < 0 || (uint64_t)slot[i] >= SLOT_MASK) {
            PyErr_SetString(PyExc_ValueError, "admit: slots must lie in [0, 2**56 - 1)");
            goto done;
        }
    }
    const uint8_t *source = rows.buf;
    int64_t added = 0, pinned, dropped;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cache->lock);
    pinned = cache->pinned;
    dropped = cache->dropped;
    for (int64_t i = 0; i < count; i++) {
        if (i + AHEAD < count)
            __builtin_prefetch(cache->word + set_index(cache, slot[i + AHEAD]) * cache->ways);
        added += admit_one(cache, slot[i], source + i * row_bytes, pin);
    }
    pinned = cache->pinned - pinned;
    dropped = cache->dropped - dropped;
    pthread_mutex_unlock(&cache->lock);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("LLL", (long long)added, (long long)pinned, (long long)dropped);
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&rows);
    return result;
}

/* reset(cache, forget): release every pin; with `forget`, empty every entry too. */
PyObject *hostcache_reset(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    int forget;
    if (!PyArg_ParseTuple(args, "Op", &capsule, &forget))
        return NULL;
    host_cache *cache = host_cache_of(capsule);
    if (!cache)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cache->lock);
    int64_t entries = cache->sets * cache->ways;
    if (forget)
        memset(cache->word, 0, (size_t)entries * sizeof(uint64_t));
    else
        for (int64_t entry = 0; entry < entries; entry++)
            cache->word[entry] &= ~PINNED;
    cache->pinned = 0;
    pthread_mutex_unlock(&cache->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* counts(cache) -> (hits, misses, read_ahead_hits, pinned, dropped): lookups' hits and misses
 * (Python's and the step service's), hits on pinned entries, entries pinned now, rows dropped. */
PyObject *hostcache_counts(PyObject *self, PyObject *args)
{
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule))
        return NULL;
    host_cache *cache = host_cache_of(capsule);
    if (!cache)
        return NULL;
    int64_t counts[5];
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&cache->lock);
    counts[0] = cache->hits;
    counts[1] = cache->misses;
    counts[2] = cache->read_ahead_hits;
    counts[3] = cache->pinned;
    counts[4] = cache->dropped;
    pthread_mutex_unlock(&cache->lock);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("LLLLL", (long long)counts[0], (long long)counts[1], (long long)counts[2],
                         (long long)counts[3], (long long)counts[4]);
}
