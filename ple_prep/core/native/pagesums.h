/* The page checksums of docs/FORMAT.md's page-sums file: the low 32 bits of XXH64 (seed 0) of each
 * table page (pagesums.c). */
#ifndef PLE_PREP_PAGESUMS_H
#define PLE_PREP_PAGESUMS_H
#include <stddef.h>
#include <stdint.h>

/* XXH64, seed 0, of `length` bytes, `length` a multiple of 32 (a table page always is). */
uint64_t xxh64_stripes(const unsigned char *data, size_t length);

#endif
