"""The optional compiled helpers, built when a C compiler is there, skipped (numpy fallback, same
results) when not: ple_prep.core._native (the rows copy and slot lookup of the format layer, the
n-gram hash, the profile's counting and the planner's page packing) and ple_prep.runtime._native
(the runtime's staging, thread pool and CUDA driver calls), which reuses core/native's row
addressing and page sums, and holds the host cache's loops. Everything else is in pyproject.toml."""
from setuptools import Extension, setup

CORE = "ple_prep/core/native/"
RUNTIME = "ple_prep/runtime/native/"
SHARED = [CORE + "buffers.c", CORE + "guard.c", CORE + "slots.c", CORE + "pagesums.c"]
# Hidden symbols: the two modules each carry the shared files, and only their init functions are exported.
FLAGS = ["-O2", "-fvisibility=hidden"]

setup(ext_modules=[
    Extension("ple_prep.core._native",
              [CORE + name for name in ("module.c", "ngramcount.c", "pack.c", "rankindex.c")] + SHARED,
              extra_compile_args=FLAGS, optional=True,
              depends=[CORE + name for name in ("buffers.h", "guard.h", "pagesums.h", "rows.h", "ngramcount.h",
                                                 "pack.h", "rankindex.h")]),
    Extension("ple_prep.runtime._native",
              [RUNTIME + name for name in ("module.c", "view.c", "stage.c", "pool.c", "jobs.c", "cuda.c", "hostcache.c",
                                           "steps.c", "memops.c", "disk_reads.c", "disk_fill.c", "readahead.c",
                                           "failure_record.c")]
              + SHARED,
              extra_compile_args=FLAGS, optional=True,
              depends=[CORE + "buffers.h", CORE + "guard.h", CORE + "pagesums.h", CORE + "rows.h"]
              + [RUNTIME + name for name in ("cuda.h", "hostcache.h", "jobs.h", "pool.h", "stage.h", "view.h",
                                             "steps.h", "memops.h", "disk_reads.h", "disk_fill.h", "readahead.h",
                                             "failure_record.h")]),
])
