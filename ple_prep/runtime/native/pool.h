/* The compiled runtime's thread pool (pool.c), and the clock and spin hint its users share. */
#ifndef PLE_PREP_POOL_H
#define PLE_PREP_POOL_H
#include <stdint.h>
#include <time.h>

#define MAX_THREADS 64

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline uint64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

typedef void part_fn(void *context, int part);

/* Run run(context, part) for parts 0..parts-1 on this thread and up to parts - 1 workers; returns
 * when all are done. Called without the GIL. */
void run_parts(part_fn *run, void *context, int parts);

/* Keep the workers polling (delta 1) or let them sleep again (delta -1). */
void pool_hold(int delta);

/* After fork only the forking thread exists: the child starts its own workers when it needs them. */
void pool_after_fork(void);

#endif
