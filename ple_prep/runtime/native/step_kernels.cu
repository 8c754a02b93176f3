/* A small step's device half as two kernels on the caller's stream (runtime/device/steps.py): no
 * side stream, no stream memory operation, no copy engine, each of which costs a decode step
 * microseconds (docs/RUNTIME.md, "Kernels for small steps"). step_kernels.ptx is this file compiled
 * by scripts/build-step-kernels.sh; memops.c loads it through the driver.
 *
 * Both kernels run on any number of blocks: a counter in device memory, zero between steps, tells
 * the last block that every other block is past the point that matters, and that block resets it. */

/* The step's ids copied into pinned host memory with the kernel's own stores, then, once every block's
 * stores are visible to the host (system fence), `count` written into the request flag. */
extern "C" __global__ void step_request(const long long *ids, long long *host_ids, unsigned *blocks_done,
                                        volatile unsigned *request, unsigned count)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += blockDim.x * gridDim.x)
        host_ids[i] = ids[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(blocks_done, 1u) == gridDim.x - 1) {
        *blocks_done = 0u;
        *request = count;
    }
}

/* The device's arrival marked (block 0), the wait until the service thread's host store into the
 * ready flag (every block), its reset and the arrival's (the last block to see it: the thread read the
 * arrival before it stored the ready flag, so a step's arrival never stays for the next), then the copy of `bytes` staged
 * bytes from pinned `source` to device `target` with uncached loads (the host wrote them after the
 * kernel started). Where both addresses have the same offset from 16-byte alignment (the step
 * lookup's buffers see to it, runtime/device/buffers.py), head and tail bytes go singly and the rest as
 * 16-byte words; else every byte goes singly. */
extern "C" __global__ void step_fetch(volatile unsigned *ready, volatile unsigned *arrived, unsigned *blocks_seen,
                                      const unsigned char *source, unsigned char *target, unsigned long long bytes)
{
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0)
            *arrived = 1u;
        while (*ready == 0u) {
        }
        __threadfence_system();
        if (atomicAdd(blocks_seen, 1u) == gridDim.x - 1) {
            *blocks_seen = 0u;
            *ready = 0u;
            *arrived = 0u;
            __threadfence_system();
        }
    }
    __syncthreads();
    unsigned long long first = blockIdx.x * blockDim.x + threadIdx.x, stride = blockDim.x * gridDim.x;
    unsigned long long head = (16u - ((unsigned long long)source & 15u)) & 15u;
    if (head > bytes || (((unsigned long long)source ^ (unsigned long long)target) & 15u) != 0)
        head = bytes;
    unsigned long long words = (bytes - head) / 16u, tail_at = head + 16u * words;
    for (unsigned long long i = first; i < head; i += stride)
        target[i] = __ldcv(source + i);
    const int4 *source_words = (const int4 *)(source + head);
    int4 *target_words = (int4 *)(target + head);
    for (unsigned long long i = first; i < words; i += stride)
        target_words[i] = __ldcv(source_words + i);
    for (unsigned long long i = tail_at + first; i < bytes; i += stride)
        target[i] = __ldcv(source + i);
}
