#include <string.h>

#include "pagesums.h"

/* XXH64 (github.com/Cyan4973/xxHash, xxhash.h's specification) of an input whose length is a
 * multiple of 32 bytes: the stripe loop, the lanes' merge and the avalanche, with no tail. */

#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P3 1609587929392839161ULL
#define P4 9650029242287828579ULL

static inline uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t xxh_round(uint64_t accumulator, uint64_t input)
{
    return rotl(accumulator + input * P2, 31) * P1;
}

static inline uint64_t xxh_merge(uint64_t hash, uint64_t lane)
{
    return (hash ^ xxh_round(0, lane)) * P1 + P4;
}

static inline uint64_t read64(const unsigned char *at)
{
    uint64_t value;
    memcpy(&value, at, sizeof(value)); /* little-endian hosts only (setup.py builds for x86-64 and arm64) */
    return value;
}

uint64_t xxh64_stripes(const unsigned char *data, size_t length)
{
    uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = 0 - P1;
    for (size_t at = 0; at < length; at += 32) {
        v1 = xxh_round(v1, read64(data + at));
        v2 = xxh_round(v2, read64(data + at + 8));
        v3 = xxh_round(v3, read64(data + at + 16));
        v4 = xxh_round(v4, read64(data + at + 24));
    }
    uint64_t hash = length >= 32 ? rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18) : v3 + 2870177450012600261ULL;
    if (length >= 32) {
        hash = xxh_merge(hash, v1);
        hash = xxh_merge(hash, v2);
        hash = xxh_merge(hash, v3);
        hash = xxh_merge(hash, v4);
    }
    hash += length;
    hash ^= hash >> 33;
    hash *= P2;
    hash ^= hash >> 29;
    hash *= P3;
    hash ^= hash >> 32;
    return hash;
}
