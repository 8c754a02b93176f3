/* The host cache (hostcache.c): runtime/hostcache.py's rows and tags, behind a lock of its own so
 * that the step service's thread (steps.c), which never takes the GIL, shares it with Python's
 * lookups, admissions and read-ahead. */
#ifndef PLE_PREP_HOSTCACHE_H
#define PLE_PREP_HOSTCACHE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct host_cache host_cache;

/* The cache a capsule of hostcache_new holds, or NULL with an exception set (with the GIL). */
host_cache *host_cache_of(PyObject *capsule);
int64_t host_cache_row_bytes(const host_cache *cache);

/* Without the GIL, between host_cache_lock and host_cache_unlock: */
void host_cache_lock(host_cache *cache);
void host_cache_unlock(host_cache *cache);
/* Copy the row of `slot` to `target` if the cache holds it (marked referenced, its pin taken):
 * 1 (a hit, counted; *was_pinned says whether read-ahead had brought it) or 0 (a miss, counted). */
int host_cache_copy(host_cache *cache, int64_t slot, char *target, int *was_pinned);
/* Fetch the words of `slot`'s set toward the CPU's cache (a lookup of it comes soon). */
void host_cache_prefetch(const host_cache *cache, int64_t slot);
/* Admit `row` for `slot` (unpinned) unless cached or its set holds only pinned entries. */
void host_cache_insert(host_cache *cache, int64_t slot, const char *row);
/* Read-ahead's calls (disk_reads.c's disk_reader_fill): whether the cache holds `slot` (marked
 * referenced if so, as hostcache_probe marks it); `row` admitted for `slot` pinned unless cached
 * (left as it is) or its set holds only pinned entries (dropped): 1 if admitted; entries pinned now. */
int host_cache_holds(host_cache *cache, int64_t slot);
int host_cache_insert_pinned(host_cache *cache, int64_t slot, const char *row);
int64_t host_cache_pinned(const host_cache *cache);

PyObject *hostcache_new(PyObject *self, PyObject *args);
PyObject *hostcache_lookup(PyObject *self, PyObject *args);
PyObject *hostcache_probe(PyObject *self, PyObject *args);
PyObject *hostcache_admit(PyObject *self, PyObject *args);
PyObject *hostcache_reset(PyObject *self, PyObject *args);
PyObject *hostcache_counts(PyObject *self, PyObject *args);

#define HOSTCACHE_METHODS \
    {"hostcache_new", hostcache_new, METH_VARARGS, "A host cache over its arrays, with its own lock."}, \
    {"hostcache_lookup", hostcache_lookup, METH_VARARGS, "Copy a request's cached rows out; list the slots missed."}, \
    {"hostcache_probe", hostcache_probe, METH_VARARGS, "Mark a request's cached slots referenced; list the others."}, \
    {"hostcache_admit", hostcache_admit, METH_VARARGS, "Admit rows into the host cache by per-set clock."}, \
    {"hostcache_reset", hostcache_reset, METH_VARARGS, "Release every pin, or forget every row."}, \
    {"hostcache_counts", hostcache_counts, METH_VARARGS, "(hits, misses, read_ahead_hits, pinned, dropped)."},

#endif
