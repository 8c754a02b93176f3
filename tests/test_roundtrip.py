"""Convert a fixture checkpoint, read it back, and compare with the source bytes."""
from __future__ import annotations

import numpy as np
import pytest

from ple_prep.converters import open_source
from ple_prep.offline.writer import convert
from ple_prep.runtime import open_table


@pytest.mark.parametrize("variant", ["fp8_checkpoint", "bf16_checkpoint", "nvfp4_checkpoint"])
def test_convert_gather_returns_source_bytes(variant, request, tmp_path):
    checkpoint = request.getfixturevalue(variant)
    with open_source(checkpoint) as source:
        convert(source, tmp_path / "t.bin")
        expected = source.read_rows(0, source.num_rows)
    with open_table(tmp_path / "t.bin") as table:
        ids = np.random.default_rng(1).permutation(table.num_rows)
        assert np.array_equal(table.gather(ids), expected[ids])


@pytest.mark.parametrize("cached_steps", [0, 2, None])
@pytest.mark.parametrize("head_steps", [0, 3, None])
def test_convert_planned_while_hashing_writes_the_same_table(fp8_checkpoint, tmp_path, monkeypatch, head_steps,
                                                             cached_steps):
    """A plan run inside convert (the source's head hashed meanwhile, here `head_steps` reads of a
    few rows, or the whole table; the first `cached_steps` of them, or all, left in the page cache
    for the write to read back) writes the bytes and checksums of the same layout given ready."""
    import hashlib
    import threading

    from ple_prep.format.layout import TableLayout
    from ple_prep.format.order import RowOrder
    from ple_prep.offline import writer
    from ple_prep.offline.direct_io import DirectRows

    monkeypatch.setattr(writer, "WARM_STEP_BYTES", 7 * 160)
    monkeypatch.setattr(writer, "WARM_SHARE_OF_AVAILABLE", 1)
    cached_bytes = 1 << 40 if cached_steps is None else cached_steps * 7 * 160
    monkeypatch.setattr(writer, "_available_memory", lambda: cached_bytes)
    with open_source(fp8_checkpoint) as source:
        rng = np.random.default_rng(5)
        layout = TableLayout(RowOrder.from_placed(rng.permutation(source.num_rows)[:source.num_rows // 3],
                                                  source.num_rows))
        given = convert(source, tmp_path / "given.bin", layout=layout)
        rows = source.read_rows(0, source.num_rows)
        # The hasher reads no more rows than the page cache may keep.
        steps = min(-(-source.num_rows // 7) if head_steps is None else head_steps,
                    -(-source.num_rows // 7) if cached_steps is None else cached_steps)
        reads, enough = [0], threading.Event()

        def counted(read):
            def counting(self, *args, **kwargs):
                out = read(self, *args, **kwargs)
                if threading.current_thread().name.startswith("convert-head"):
                    reads[0] += 1
                    if reads[0] >= steps:
                        enough.set()
                return out
            return counting

        # Rows the hasher left in the page cache are read through the source, the others with DirectRows.
        monkeypatch.setattr(DirectRows, "read", counted(DirectRows.read))
        monkeypatch.setattr(type(source), "read_rows", counted(type(source).read_rows))

        def plan():
            assert steps == 0 or enough.wait(30)
            return layout

        planned = convert(source, tmp_path / "planned.bin", plan=plan)
    assert reads[0] >= steps
    expected = hashlib.sha256(rows.tobytes()).hexdigest()
    assert planned["source"]["table_sha256"] == given["source"]["table_sha256"] == expected
    assert planned["checksums"]["blocks"] == given["checksums"]["blocks"]
    offset = given["data_offset"]
    assert (tmp_path / "planned.bin").read_bytes()[offset:] == (tmp_path / "given.bin").read_bytes()[offset:]
