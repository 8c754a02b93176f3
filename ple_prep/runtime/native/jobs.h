/* stage_when and stage_joined (jobs.c): a stage on a thread of its own, started by a device's flags. */
#ifndef PLE_PREP_JOBS_H
#define PLE_PREP_JOBS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *stage_when(PyObject *self, PyObject *args);
PyObject *stage_joined(PyObject *self, PyObject *args);
PyObject *stage_job_checks(PyObject *self, PyObject *args);

#endif
