#include <dlfcn.h>
#include <pthread.h>

#include "cuda.h"

/* The CUDA driver (libcuda), opened at the first call that needs it: torch has loaded it by then. */
cuda_driver cuda;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;

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
        {(void **)&cuda.stream_create, "cuStreamCreate"},
        {(void **)&cuda.stream_destroy, "cuStreamDestroy_v2"},
        {(void **)&cuda.event_create, "cuEventCreate"},
        {(void **)&cuda.event_destroy, "cuEventDestroy_v2"},
        {(void **)&cuda.event_record, "cuEventRecord"},
        {(void **)&cuda.event_synchronize, "cuEventSynchronize"},
        {(void **)&cuda.graph_launch, "cuGraphLaunch"},
        {(void **)&cuda.stream_is_capturing, "cuStreamIsCapturing"},
        {(void **)&cuda.get_error_name, "cuGetErrorName"},
        {(void **)&cuda.module_load_data, "cuModuleLoadData"},
        {(void **)&cuda.module_get_function, "cuModuleGetFunction"},
        {(void **)&cuda.module_unload, "cuModuleUnload"},
        {(void **)&cuda.launch_kernel, "cuLaunchKernel"},
    };
    for (size_t k = 0; k < sizeof(symbols) / sizeof(symbols[0]); k++)
        if (!(*symbols[k].function = dlsym(library, symbols[k].name)))
            return;
    cuda.loaded = 1;
}

int cuda_ready(void)
{
    pthread_once(&cuda_once, load_cuda);
    if (cuda.loaded)
        return 0;
    PyErr_SetString(PyExc_OSError, "the CUDA driver (libcuda.so.1) cannot be loaded");
    return -1;
}

PyObject *refuse_cuda(const char *what, cuda_result result)
{
    const char *name = NULL;
    if (!cuda.get_error_name || cuda.get_error_name(result, &name) != 0 || !name)
        name = "an error the driver does not name";
    return PyErr_Format(PyExc_RuntimeError, "%s failed: %s (CUDA error %d)", what, name, result);
}

int parse_pointer(PyObject *object, void *pointer)
{
    *(void **)pointer = PyLong_AsVoidPtr(object);
    return !PyErr_Occurred();
}

cuda_result enter_context(void *context, void **previous)
{
    cuda_result result = cuda.get_context(previous);
    if (result == 0 && *previous != context)
        result = cuda.set_context(context);
    return result;
}

void leave_context(void *context, void *previous)
{
    if (previous != context)
        cuda.set_context(previous);
}
