/* cuStreamWriteValue32 and cuStreamBatchMemOp (memops.c), opened beside cuda.c's driver table. */
#ifndef PLE_PREP_MEMOPS_H
#define PLE_PREP_MEMOPS_H
#include <stdint.h>

#include "cuda.h"

extern cuda_result (*write_value32)(void *, unsigned long long, uint32_t, unsigned);

/* 0 once both are loaded (and cuda.c's table), else -1 with an OSError set. */
int memops_ready(void);

#endif
