/* The host cache's lookup and admission (ple_prep/runtime/hostcache.py): loops over a request's
 * slots that numpy runs as a dozen passes; functions of ple_prep.runtime._native (hostcache.h).
 *
 * The cache is set-associative: slot s lives in set ((h >> 32) * sets) >> 32, h = s * K mod 2**64
 * (hostcache.py computes the same), in one of the set's `ways` entries. An entry is a 64-bit word
 * (the slot + 1 in the low 56 bits, flags in the top byte; 0 when empty, so fresh memory is an
 * empty cache) and the row's bytes,
 * in two caller-owned arrays; one byte per set holds its clock hand. Keeping the flags in the word
 * means a lookup touches one line of words per set and the row, nothing else.
 *
 * Each function runs with the GIL held from its first read of the arrays to its last write: Python
 * code (a read-ahead thread, another gather) cannot change an entry while a row is copied out of
 * it, so a row copied is always the row its word names. Slots and rows are int64 and uint8 arrays
 * (hostcache.py converts them); every index into the cache's arrays derives from the geometry
 * checked here, never from a caller's value.
 *
 * Flags: REFERENCED (a hit since the set's clock hand last passed the entry) and PINNED (read ahead
 * and not yet looked up: never evicted). hostcache.py documents the policy.
 */
#include "hostcache.h"

#include <stdint.h>
#include <string.h>

#define SLOT_MASK ((uint64_t)0x00FFFFFFFFFFFFFFull)
#define REFERENCED ((uint64_t)1 << 56)
#define PINNED ((uint64_t)2 << 56)
#define EMPTY ((uint64_t)0)
/* The pipeline of `lookup`: a set's words are fetched this many slots ahead of the slot being
 * copied, its row half as many. */
#define AHEAD 16
#define RING 32

typedef struct {
    Py_buffer words, data, hands;
    int64_t sets, ways, row_bytes;
} Cache;

static const uint64_t MULTIPLIER = 0x9E3779B97F4A7C15ull;

static inline int64_t set_index(const Cache *cache, int64_t slot) {
    return (int64_t)(((((uint64_t)slot * MULTIPLIER) >> 32) * (uint64_t)cache->sets) >> 32);
}

static void release_cache(Cache *cache) {
    PyBuffer_Release(&cache->words);
    PyBuffer_Release(&cache->data);
    PyBuffer_Release(&cache->hands);
}

/* Views of the cache's arrays, their sizes checked against one another. */
static int get_cache(Cache *cache, PyObject *words, PyObject *data, PyObject *hands, Py_ssize_t ways,
                     Py_ssize_t row_bytes) {
    memset(cache, 0, sizeof(*cache));
    if (PyObject_GetBuffer(words, &cache->words, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0
        || PyObject_GetBuffer(data, &cache->data, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0
        || PyObject_GetBuffer(hands, &cache->hands, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        release_cache(cache);
        return -1;
    }
    int64_t entries = cache->words.len / 8;
    cache->ways = ways;
    cache->row_bytes = row_bytes;
    cache->sets = cache->hands.len;
    if (ways < 1 || ways > 255 || row_bytes < 1 || cache->sets < 1 || cache->sets >= ((int64_t)1 << 32)
        || cache->sets * ways != entries || cache->data.len != entries * row_bytes) {
        release_cache(cache);
        PyErr_SetString(PyExc_ValueError, "host cache arrays disagree on their geometry");
        return -1;
    }
    return 0;
}

/* The entry holding `slot`, or -1. */
static inline int64_t find(const Cache *cache, const uint64_t *word, int64_t slot) {
    int64_t first = set_index(cache, slot) * cache->ways;
    for (int64_t way = 0; way < cache->ways; way++)
        if ((word[first + way] & SLOT_MASK) == (uint64_t)slot + 1) return first + way;
    return -1;
}

static int get_slots(PyObject *object, Py_buffer *view, int64_t *count) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    *count = view->len / 8;
    return 0;
}

/* lookup(slots, out, positions, misses, words, data, hands, ways, row_bytes) -> (missed, unpinned)
 * Each slot found is copied to out[positions[i]] (out[i] without positions) and its entry marked
 * referenced and unpinned; the indexes i of the others go to misses[0:missed]. */
PyObject *hostcache_lookup(PyObject *self, PyObject *args)
{
    PyObject *slots_obj, *out_obj, *positions_obj, *misses_obj, *words, *data, *hands;
    Py_ssize_t ways, row_bytes;
    if (!PyArg_ParseTuple(args, "OOOOOOOnn", &slots_obj, &out_obj, &positions_obj, &misses_obj, &words, &data,
                          &hands, &ways, &row_bytes))
        return NULL;
    Cache cache;
    if (get_cache(&cache, words, data, hands, ways, row_bytes) < 0) return NULL;
    Py_buffer slots = {0}, out = {0}, positions = {0}, misses = {0};
    PyObject *result = NULL;
    int64_t count = 0;
    if (get_slots(slots_obj, &slots, &count) < 0) goto done;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (positions_obj != Py_None && PyObject_GetBuffer(positions_obj, &positions, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(misses_obj, &misses, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    int64_t out_rows = out.len / row_bytes;
    if (misses.len / 8 < count || (positions.obj && positions.len / 8 != count) || out.len % row_bytes
        || (!positions.obj && out_rows != count)) {
        PyErr_SetString(PyExc_ValueError, "lookup: slots, out, positions and misses disagree in length");
        goto done;
    }
    const int64_t *slot = slots.buf, *position = positions.obj ? positions.buf : NULL;
    int64_t *missed = misses.buf;
    uint64_t *word = cache.words.buf;
    uint8_t *rows = cache.data.buf, *target = out.buf;
    if (position) {
        for (int64_t i = 0; i < count; i++) {
            if (position[i] < 0 || position[i] >= out_rows) {
                PyErr_SetString(PyExc_IndexError, "lookup: a position lies outside out");
                goto done;
            }
        }
    }
    /* The words of slot i + AHEAD are fetched while slot i is looked up and its row fetched, and
     * slot i - AHEAD / 2's row is copied: each row costs a copy, not two trips to memory in turn
     * (the cache is far larger than the CPU's). found[i % RING] is slot i's entry. */
    int64_t found[RING], missed_count = 0, unpinned = 0;
    for (int64_t i = 0; i < count + AHEAD / 2; i++) {
        if (i + AHEAD < count) __builtin_prefetch(word + set_index(&cache, slot[i + AHEAD]) * ways);
        if (i < count) {
            int64_t entry = find(&cache, word, slot[i]);
            found[i % RING] = entry;
            if (entry >= 0)
                for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(rows + entry * row_bytes + line);
        }
        int64_t j = i - AHEAD / 2;
        if (j < 0) continue;
        int64_t entry = found[j % RING];
        if (entry < 0) {
            missed[missed_count++] = j;
            continue;
        }
        memcpy(target + (position ? position[j] : j) * row_bytes, rows + entry * row_bytes, row_bytes);
        uint64_t value = word[entry];
        unpinned += (value & PINNED) != 0;
        if ((value & ~SLOT_MASK) != REFERENCED) word[entry] = (value & SLOT_MASK) | REFERENCED;
    }
    result = Py_BuildValue("LL", (long long)missed_count, (long long)unpinned);
done:
    release_cache(&cache);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&out);
    PyBuffer_Release(&positions);
    PyBuffer_Release(&misses);
    return result;
}

/* probe(slots, misses, words, data, hands, ways, row_bytes) -> missed
 * Read-ahead's check: each slot found is marked referenced (nothing copied, no pin taken); the
 * indexes i of the others go to misses[0:missed]. */
PyObject *hostcache_probe(PyObject *self, PyObject *args)
{
    PyObject *slots_obj, *misses_obj, *words, *data, *hands;
    Py_ssize_t ways, row_bytes;
    if (!PyArg_ParseTuple(args, "OOOOOnn", &slots_obj, &misses_obj, &words, &data, &hands, &ways, &row_bytes))
        return NULL;
    Cache cache;
    if (get_cache(&cache, words, data, hands, ways, row_bytes) < 0) return NULL;
    Py_buffer slots = {0}, misses = {0};
    PyObject *result = NULL;
    int64_t count = 0;
    if (get_slots(slots_obj, &slots, &count) < 0) goto done;
    if (PyObject_GetBuffer(misses_obj, &misses, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (misses.len / 8 < count) {
        PyErr_SetString(PyExc_ValueError, "probe: misses is shorter than slots");
        goto done;
    }
    const int64_t *slot = slots.buf;
    int64_t *missed = misses.buf, missed_count = 0;
    uint64_t *word = cache.words.buf;
    for (int64_t i = 0; i < count; i++) {
        if (i + AHEAD < count) __builtin_prefetch(word + set_index(&cache, slot[i + AHEAD]) * ways);
        int64_t entry = find(&cache, word, slot[i]);
        if (entry < 0)
            missed[missed_count++] = i;
        else
            word[entry] |= REFERENCED;
    }
    result = PyLong_FromLongLong(missed_count);
done:
    release_cache(&cache);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&misses);
    return result;
}

/* admit(slots, rows, pin, words, data, hands, ways, row_bytes) -> (added, pinned, dropped)
 * Each slot not in the cache takes an entry of its set chosen by the set's clock hand: the hand
 * passes pinned entries, clears the referenced mark of the ones it passes, and takes the first
 * entry with neither; rows[i] is copied there. With pin, entries (new or found) are pinned. A
 * slot whose set holds only pinned entries is dropped (not admitted). Slots outside
 * [0, 2**56 - 1) are refused. */
PyObject *hostcache_admit(PyObject *self, PyObject *args)
{
    PyObject *slots_obj, *rows_obj, *words, *data, *hands;
    int pin;
    Py_ssize_t ways, row_bytes;
    if (!PyArg_ParseTuple(args, "OOpOOOnn", &slots_obj, &rows_obj, &pin, &words, &data, &hands, &ways, &row_bytes))
        return NULL;
    Cache cache;
    if (get_cache(&cache, words, data, hands, ways, row_bytes) < 0) return NULL;
    Py_buffer slots = {0}, rows = {0};
    PyObject *result = NULL;
    int64_t count = 0;
    if (get_slots(slots_obj, &slots, &count) < 0) goto done;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_C_CONTIGUOUS) < 0) goto done;
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
    uint64_t *word = cache.words.buf;
    uint8_t *hand = cache.hands.buf, *store = cache.data.buf;
    int64_t added = 0, pinned = 0, dropped = 0;
    for (int64_t i = 0; i < count; i++) {
        if (i + AHEAD < count) __builtin_prefetch(word + set_index(&cache, slot[i + AHEAD]) * ways);
        int64_t set = set_index(&cache, slot[i]), first = set * ways;
        int64_t entry = find(&cache, word, slot[i]);
        if (entry >= 0) {
            if (pin && !(word[entry] & PINNED)) {
                word[entry] |= PINNED;
                pinned++;
            }
            continue;
        }
        /* Two turns: the first may only clear referenced marks. */
        for (int64_t step = 0; step < 2 * ways; step++) {
            int64_t candidate = first + hand[set];
            hand[set] = (uint8_t)((hand[set] + 1) % ways);
            uint64_t value = word[candidate];
            if (value == EMPTY) {
                entry = candidate;
                break;
            }
            if (value & PINNED) continue;
            if (value & REFERENCED) {
                word[candidate] = value & ~REFERENCED;
                continue;
            }
            entry = candidate;
            break;
        }
        if (entry < 0) {
            dropped++;
            continue;
        }
        word[entry] = ((uint64_t)slot[i] + 1) | (pin ? PINNED : 0);
        memcpy(store + entry * row_bytes, source + i * row_bytes, row_bytes);
        added++;
        pinned += pin;
    }
    result = Py_BuildValue("LLL", (long long)added, (long long)pinned, (long long)dropped);
done:
    release_cache(&cache);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&rows);
    return result;
}
