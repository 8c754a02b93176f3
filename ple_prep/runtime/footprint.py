"""A bound on the mapped table's footprint: the data region's pages advised away past a budget.

Every page a copy through the mapping touches stays mapped into the process until it is unmapped,
so a long-running server's RssFile creeps toward the whole table (and its page tables with it: 8
bytes per 4 KiB page, a 4 KiB table per 2 MiB of the mapping touched). A fault maps not only its own page
but the cached pages around it (the kernel's fault-around, 64 KiB by default, which MADV_RANDOM
does not turn off), so a few rows of a cached table map many pages. `MappedBudget` keeps
the process's RssFile (file-backed resident memory, /proc/self/statm) under `budget_bytes`: it
counts FAULT_AROUND_BYTES for every row copied through the mapping (an upper bound of what the copy
can map), reads RssFile only when that count could have crossed the budget, and when RssFile is
over it advises the table's whole data region away in one `madvise` call:
- "dontneed" (`MADV_DONTNEED`, the default): unmaps the pages (RssFile drops, and with it the page
  tables' entries); the pages stay in the page cache, still charged to the memory cgroup but now
  unmapped, so the kernel reclaims them first and cheaply. A later copy of a cached row costs a
  minor fault.
- "pageout" (`MADV_PAGEOUT`): also reclaims the pages from the page cache where no other process
  maps them, so the cgroup's usage drops too; a later copy of such a row reads the disk again.

The order map before the data region is left alone: every lookup reads it. The budget covers the
process's other file mappings too (the libraries of numpy and, far larger, of torch's CUDA build):
set it above them. RssFile may pass the budget by what one request maps. The measurements are in
docs/benchmark-history.md, "Memory: pressure and the mapped footprint".
"""
from __future__ import annotations

import mmap

# What one fault may map: Linux's default fault_around_bytes.
FAULT_AROUND_BYTES = 64 << 10
# The least mapping growth between two reads of RssFile.
MIN_SLACK_BYTES = 1 << 20
# Linux's values; Python's mmap module names MADV_PAGEOUT only where its build headers had it.
ADVICE = {"dontneed": mmap.MADV_DONTNEED, "pageout": getattr(mmap, "MADV_PAGEOUT", 21)}


def rss_file_bytes() -> int:
    """This process's file-backed (and shared-memory) resident bytes: /proc/self/statm's third field."""
    with open("/proc/self/statm", "rb") as handle:
        return int(handle.read().split()[2]) * mmap.PAGESIZE


class MappedBudget:
    """Keeps this process's RssFile under `budget_bytes` by advising one table's data region away,
    give or take what one request maps."""

    def __init__(self, mapping: mmap.mmap, header, budget_bytes: int, advice: str = "dontneed"):
        if budget_bytes <= 0:
            raise ValueError("mapped_budget_bytes must be > 0")
        if advice not in ADVICE:
            raise ValueError(f"budget advice must be one of {', '.join(ADVICE)}, not {advice!r}")
        self.budget_bytes = int(budget_bytes)
        self.advice = advice
        self._mapping = mapping
        self._start = header.data_offset - header.data_offset % mmap.PAGESIZE
        self._length = len(mapping) - self._start
        self._unchecked = 0
        self._slack = 0
        self.releases = 0

    def charge(self, rows: int) -> None:
        """Count `rows` rows about to be copied through the mapping; release first if over budget."""
        self._unchecked += rows * FAULT_AROUND_BYTES
        if self._unchecked < self._slack:
            return
        resident = rss_file_bytes()
        if resident > self.budget_bytes:
            self.release()
            resident = rss_file_bytes()
        self._unchecked = 0
        # Where other mappings alone pass the budget, still check only every MIN_SLACK_BYTES.
        self._slack = max(self.budget_bytes - resident, MIN_SLACK_BYTES)

    def release(self) -> None:
        """Advise the whole data region away now."""
        self._mapping.madvise(ADVICE[self.advice], self._start, self._length)
        self.releases += 1
