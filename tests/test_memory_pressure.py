"""Cold gathers inside a memory cgroup with less room than an unbounded advice window wants."""
from __future__ import annotations

import numpy as np
import pytest

from bench.memcap import cgroups_unavailable, measure
from ple_prep.runtime import open_table
from ple_prep.tools.fixtures import make_checkpoint

pytestmark = pytest.mark.skipif(cgroups_unavailable() is not None,
                                reason=f"memory cgroups: {cgroups_unavailable()}")

LIMIT = 320 << 20
HEADROOM = 12 << 20


@pytest.fixture(scope="module")
def table_and_ids(tmp_path_factory, converted_table):
    """A 60 MiB table (about 15,000 pages) and a request touching most of its pages once."""
    folder = tmp_path_factory.mktemp("pressure")
    converted_table(make_checkpoint(folder / "ckpt", base=24000, with_tokenizer=False), folder / "t.bin")
    with open_table(folder / "t.bin") as table:
        ids = np.random.default_rng(0).permutation(table.num_rows)[:12000]
    return folder / "t.bin", ids


def test_default_window_reads_each_page_once_where_an_unbounded_window_faults_them_back(table_and_ids):
    path, ids = table_and_ids
    default = measure(path, ids, limit_bytes=LIMIT, headroom_bytes=HEADROOM, options={"read_path": "mapped"})
    unbounded = measure(path, ids, limit_bytes=LIMIT, headroom_bytes=HEADROOM,
                        options={"read_path": "mapped", "window_pages": 1 << 40, "window_bytes": 1 << 50})
    assert not default["oom_killed"] and not unbounded["oom_killed"]
    pages = default["distinct_pages"]
    # The pressure is real: the cgroup hit its limit during the gathers.
    assert default["cgroup_failcnt"] > 0 and unbounded["cgroup_failcnt"] > 0
    assert default["cache_growth_bytes"] > 4 << 20
    assert default["major_faults"] <= 1.1 * pages
    assert default["major_faults"] < 0.1 * pages
    # Advice far ahead was reclaimed before use, then faulted back one page at a time.
    assert unbounded["major_faults"] > 0.5 * pages


def test_direct_reads_take_no_faults_and_no_page_cache_under_the_cap(table_and_ids):
    path, ids = table_and_ids
    # Without the host cache: its rows are anonymous memory within its own budget (test_host_cache.py
    # measures that in a cgroup); this service leaves less headroom than any useful budget.
    direct = measure(path, ids, limit_bytes=LIMIT, headroom_bytes=HEADROOM, options={"host_cache_bytes": 0})
    assert not direct["oom_killed"]
    if direct["read_path"] != "direct":
        pytest.skip("O_DIRECT unavailable here")
    assert direct["major_faults"] == 0
    # Nothing read is charged as page cache (the mapped path fills the headroom with it).
    assert direct["cache_growth_bytes"] < 1 << 20
