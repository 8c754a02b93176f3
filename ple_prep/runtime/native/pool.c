#include <pthread.h>
#include <stdatomic.h>

#include "pool.h"

/* --- A small thread pool for `stage`: Python's threads pay a GIL handoff and a queue per part,
 * which on a virtual machine's slow wakeups cost more than the part itself. Workers take parts of
 * the current job by claiming them from one atomic ticket (generation, parts, next part), poll
 * for the next job for SPIN_NS after finishing one (a request's copy phase, which follows its
 * lookup within microseconds, then starts at once) and sleep on a condition variable after that.
 * A stage_when job waiting for its flags holds the pool (pool_hold): the workers poll meanwhile,
 * so its parts start at once instead of after the wakeups. One job runs at a time (caller_lock). */

#define SPIN_NS 50000

typedef struct {
    part_fn *run;
    void *context;
} pool_job;

static struct {
    pthread_mutex_t caller_lock, lock;
    pthread_cond_t wake;
    int workers;
    _Atomic uint64_t ticket; /* generation << 32 | parts << 16 | next part */
    _Atomic int done_parts;
    _Atomic int held;        /* stage_when jobs about to run parts: workers poll, never sleep */
    pool_job jobs[2];        /* by generation parity: a late worker never sees the next job's */
} pool = {.caller_lock = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

/* Run parts of generation `generation` while there are unclaimed ones. */
static void take_parts(uint64_t generation)
{
    uint64_t ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    while ((ticket >> 32) == generation && (ticket & 0xffff) < ((ticket >> 16) & 0xffff)) {
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &ticket, ticket + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* The job cannot finish, nor its slot be reused, before this claimed part is done. */
        pool_job *job = &pool.jobs[generation & 1];
        job->run(job->context, (int)(ticket & 0xffff));
        atomic_fetch_add_explicit(&pool.done_parts, 1, memory_order_release);
        ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
}

static void *pool_worker(void *unused)
{
    (void)unused;
    uint64_t seen = atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32;
    for (;;) {
        uint64_t began = monotonic_ns(), generation;
        unsigned spins = 0;
        while ((generation = atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32) == seen) {
            cpu_relax();
            if (++spins % 64 != 0)
                continue;
            if (atomic_load_explicit(&pool.held, memory_order_relaxed) > 0) {
                began = monotonic_ns();
                continue;
            }
            if (monotonic_ns() - began <= SPIN_NS)
                continue;
            pthread_mutex_lock(&pool.lock);
            while ((generation = atomic_load_explicit(&pool.ticket, memory_order_acquire) >> 32) == seen
                   && atomic_load_explicit(&pool.held, memory_order_relaxed) == 0)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
            began = monotonic_ns();
        }
        seen = generation;
        take_parts(generation);
    }
    return NULL;
}

void pool_hold(int delta)
{
    atomic_fetch_add_explicit(&pool.held, delta, memory_order_relaxed);
    if (delta > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
}

void pool_after_fork(void)
{
    pthread_mutex_init(&pool.caller_lock, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = 0;
    atomic_store_explicit(&pool.held, 0, memory_order_relaxed);
}

void run_parts(part_fn *run, void *context, int parts)
{
    if (parts <= 1) {
        run(context, 0);
        return;
    }
    pthread_mutex_lock(&pool.caller_lock);
    while (pool.workers < parts - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, pool_worker, NULL);
        pthread_attr_destroy(&attributes);
        if (failed)
            break; /* fewer workers: this thread takes the parts left */
        pool.workers++;
    }
    uint64_t generation = (atomic_load_explicit(&pool.ticket, memory_order_relaxed) >> 32) + 1;
    pool.jobs[generation & 1] = (pool_job){run, context};
    atomic_store_explicit(&pool.done_parts, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.ticket, (generation << 32) | ((uint64_t)parts << 16), memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_parts(generation);
    while (atomic_load_explicit(&pool.done_parts, memory_order_acquire) < parts)
        cpu_relax();
    pthread_mutex_unlock(&pool.caller_lock);
}
