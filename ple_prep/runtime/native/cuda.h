/* The CUDA driver calls of the compiled runtime, through libcuda opened at the first use (cuda.c). */
#ifndef PLE_PREP_CUDA_H
#define PLE_PREP_CUDA_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int cuda_result; /* CUresult: 0 is success */

typedef struct {
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
    cuda_result (*stream_create)(void **, unsigned);
    cuda_result (*stream_destroy)(void *);
    cuda_result (*event_create)(void **, unsigned);
    cuda_result (*event_destroy)(void *);
    cuda_result (*event_record)(void *, void *);
    cuda_result (*event_synchronize)(void *);
    cuda_result (*graph_launch)(void *, void *);
    cuda_result (*stream_is_capturing)(void *, int *);
    cuda_result (*get_error_name)(cuda_result, const char **);
    cuda_result (*module_load_data)(void **, const void *);
    cuda_result (*module_get_function)(void **, void *, const char *);
    cuda_result (*module_unload)(void *);
    cuda_result (*launch_kernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                                 void **, void **);
} cuda_driver;
extern cuda_driver cuda;

typedef struct {
    void *context, *stream, *wait_event, *done_event;
    unsigned long long address;  /* 0: no copy asked for */
    cuda_result result;
} device_copy;

/* 0 once the CUDA driver is loaded, else -1 with an OSError set. */
int cuda_ready(void);

/* A RuntimeError "<what> failed: CUDA_ERROR_<NAME> (CUDA error <n>)"; returns NULL. */
PyObject *refuse_cuda(const char *what, cuda_result result);

/* An int argument as a pointer, for PyArg_ParseTuple's O& converter. */
int parse_pointer(PyObject *object, void *pointer);

/* Make `context` current on this thread for a few driver calls; *previous gets the caller's, which
 * leave_context restores. */
cuda_result enter_context(void *context, void **previous);
void leave_context(void *context, void *previous);

#endif
