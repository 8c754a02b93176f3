/* Copies out of a file mapping that turn a failed page read into an error instead of a SIGBUS
 * (guard.c): a page the kernel cannot read (an I/O error, a file that shrank) faults with SIGBUS
 * on the copying thread, and the handler jumps back to the copy's guard, which reports it. */
#ifndef PLE_PREP_GUARD_H
#define PLE_PREP_GUARD_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>

typedef struct {
    sigjmp_buf jump;
    const char *volatile address; /* where the fault hit, once it did */
} fault_guard;

/* The guard of the copy running on this thread, or NULL; cleared by the handler when it jumps. */
extern __thread fault_guard *current_guard __attribute__((tls_model("initial-exec")));

/* Install the SIGBUS handler (once, at a module's import); the one it replaces gets every SIGBUS
 * that no guarded copy caused. 0, or -1 with an OSError set. */
int guard_faults(void);

/* A guarded copy:
 *     fault_guard guard;
 *     if (sigsetjmp(guard.jump, 0) != 0) { the copy faulted at guard.address; }
 *     else { current_guard = &guard; copy...; current_guard = NULL; }
 * A local variable the copy changes is indeterminate after a fault unless it is volatile. */

/* The error (OSError EIO) for a fault at `address` of a mapping starting at `base`. */
void refuse_fault(const char *base, const char *address);
/* OSError(error, message), taking the reference to `message` (NULL: the error already set). */
void set_os_error(int error, PyObject *message);

#endif
