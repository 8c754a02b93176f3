/* Failure records' state words (failure_record.h). */
#include "failure_record.h"

#include "../../core/native/buffers.h"

int record_buffer_fits(const Py_buffer *view)
{
    return view->len >= RECORD_BYTES && (uintptr_t)view->buf % 8 == 0;
}

int record_claim_state(int32_t *state)
{
    int32_t empty = RECORD_EMPTY;
    return __atomic_compare_exchange_n(state, &empty, RECORD_BEING_WRITTEN, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

void record_store_state(int32_t *state, int32_t value)
{
    __atomic_store_n(state, value, __ATOMIC_RELEASE);
}

/* The state word of `record` (a writable buffer of RECORD_BYTES, 8-byte aligned), its view held. */
static int32_t *record_state_word(PyObject *record, Py_buffer *view)
{
    if (get_buffer(record, view, 1, 1, "record") != 0)
        return NULL;
    if (!record_buffer_fits(view)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a record must be 512 bytes, 8-byte aligned");
        return NULL;
    }
    return view->buf;
}

/* record_claim(record) -> bool: whether the record was empty and is now BEING_WRITTEN, for this caller
 * alone (a step service's thread claims it the same way). */
PyObject *record_claim(PyObject *self, PyObject *args)
{
    PyObject *record;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "O", &record))
        return NULL;
    int32_t *state = record_state_word(record, &view);
    if (!state)
        return NULL;
    int claimed = record_claim_state(state);
    PyBuffer_Release(&view);
    return PyBool_FromLong(claimed);
}

/* record_state(record[, state]) -> int: the state, loaded with acquire; given `state` (>= 0), stored
 * with release first, once the fields it covers are written. */
PyObject *record_state(PyObject *self, PyObject *args)
{
    PyObject *record;
    int new_state = -1;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "O|i", &record, &new_state))
        return NULL;
    int32_t *state = record_state_word(record, &view);
    if (!state)
        return NULL;
    if (new_state >= 0)
        record_store_state(state, new_state);
    int32_t now = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromLong(now);
}
