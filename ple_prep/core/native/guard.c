#include <errno.h>
#include <signal.h>
#include <string.h>

#include "guard.h"

__thread fault_guard *current_guard __attribute__((tls_model("initial-exec")));

static struct sigaction previous;

static void on_sigbus(int signal_number, siginfo_t *info, void *context)
{
    fault_guard *guard = current_guard;
    if (guard) {
        current_guard = NULL;
        guard->address = info ? (const char *)info->si_addr : NULL;
        /* SA_NODEFER left SIGBUS unblocked: jumping out keeps the thread's signal mask as it was. */
        siglongjmp(guard->jump, 1);
    }
    /* Not a guarded copy's fault: as if this handler were not there. */
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(signal_number, info, context);
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(signal_number);
    } else {
        /* The default action: restored, the faulting access runs again and faults again. */
        sigaction(SIGBUS, &previous, NULL);
    }
}

int guard_faults(void)
{
    static int installed_once;
    struct sigaction installed, ours;
    /* Once per module: a handler installed later (faulthandler's) runs first and hands the fault
     * back to this one when it is done. */
    if (installed_once)
        return 0;
    if (sigaction(SIGBUS, NULL, &installed) != 0)
        goto failed;
    memset(&ours, 0, sizeof(ours));
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    previous = installed;
    if (sigaction(SIGBUS, &ours, NULL) != 0)
        goto failed;
    installed_once = 1;
    return 0;
failed:
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

void refuse_fault(const char *base, const char *address)
{
    PyObject *message = address && address >= base
        ? PyUnicode_FromFormat("reading rows through the mapping failed at byte %lld of the file (an I/O error, "
                               "or the file shrank)", (long long)(address - base))
        : PyUnicode_FromString("reading rows through the mapping failed (an I/O error, or the file shrank)");
    set_os_error(EIO, message);
}

void set_os_error(int error, PyObject *message)
{
    if (!message)
        return;
    PyObject *arguments = Py_BuildValue("(iN)", error, message);
    if (arguments) {
        PyErr_SetObject(PyExc_OSError, arguments);
        Py_DECREF(arguments);
    }
}
