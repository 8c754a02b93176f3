"""EmbeddingSource: bf16 values equal to `Table.values` per token, from both tiers, buffers reused."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ple_prep.converters import open_source  # noqa: E402
from ple_prep.format.layout import TableLayout  # noqa: E402
from ple_prep.format.order import RowOrder  # noqa: E402
from ple_prep.ngram import row_ids  # noqa: E402
from ple_prep.offline.writer import convert  # noqa: E402
from ple_prep.runtime import open_table  # noqa: E402
from ple_prep.runtime.dequant import round_to_bf16  # noqa: E402
from ple_prep.runtime.torch import EmbeddingSource  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=["fp8_checkpoint", "bf16_checkpoint", "nvfp4_checkpoint"])
def table(request, tmp_path_factory):
    checkpoint = request.getfixturevalue(request.param)
    path = tmp_path_factory.mktemp("source") / "t.bin"
    with open_source(checkpoint) as source:
        spec = source.spec
        # Hot rows of one text placed first, so the resident tier is not simply the first rows.
        hot = np.unique(row_ids(np.random.default_rng(9).integers(0, 5000, 400), spec))
        convert(source, path, layout=TableLayout(RowOrder.from_placed(hot[::-1], source.num_rows)))
    with open_table(path) as opened:
        opened.spec = spec
        yield opened


def token_ids(table, tokens: int, seed: int) -> np.ndarray:
    """(tokens, 16) row ids of token text through the real hash, with repeated tokens."""
    rng = np.random.default_rng(seed)
    return row_ids(rng.integers(0, 5000, tokens), table.spec)


def expected_bits(table, ids: np.ndarray) -> np.ndarray:
    values = table.values(ids.reshape(-1)).reshape(len(ids), -1)
    return (round_to_bf16(values.astype(np.float64)).view(np.uint32) >> 16).astype(np.uint16)


def bits(tensor) -> np.ndarray:
    return tensor.cpu().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_source_equals_values_per_token_across_reused_buffers(table, device):
    source = EmbeddingSource(table, device=device, resident_bytes=3000 * table.row_bytes,
                             max_tokens=300)
    source.output.fill_(float("nan"))
    for tokens, seed in ((300, 1), (120, 2), (300, 3), (1, 4)):
        ids = token_ids(table, tokens, seed)
        values = source(torch.from_numpy(ids).to(device))
        assert values.shape == (tokens, 16 * table.values_per_row) and values.dtype == torch.bfloat16
        assert values.data_ptr() == source.output.data_ptr()
        assert np.array_equal(bits(values), expected_bits(table, ids))
        if tokens > 1:
            assert 0 < source.last_disk_rows < len(np.unique(ids))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_source_takes_flat_ids_and_any_integer_dtype(table, device):
    source = EmbeddingSource(table, device=device, resident_bytes=table.num_rows * table.row_bytes,
                             max_tokens=64)
    ids = token_ids(table, 64, 5)
    values = source(torch.from_numpy(ids.reshape(-1).astype(np.int32)).to(device))
    assert source.last_disk_rows == 0
    assert np.array_equal(bits(values), expected_bits(table, ids))


def test_torch_source_profile_records_every_stage(table):
    source = EmbeddingSource(table, device="cpu", resident_bytes=500 * table.row_bytes,
                             max_tokens=50)
    source.profile = True
    ids = token_ids(table, 50, 11)
    assert np.array_equal(bits(source(torch.from_numpy(ids))), expected_bits(table, ids))
    assert set(source.last_stages) == {"slots_on_device_to_host", "host_gather", "host_to_device",
                                       "tier_index", "decode"}
    assert source(torch.zeros((0, 16), dtype=torch.int64)).shape == (0, 16 * table.values_per_row)


def test_torch_source_all_from_disk(table):
    source = EmbeddingSource(table, device="cpu", resident_bytes=0, max_tokens=50)
    ids = token_ids(table, 50, 6)
    assert np.array_equal(bits(source(torch.from_numpy(ids))), expected_bits(table, ids))
    assert source.last_disk_rows == len(np.unique(ids))


def test_torch_source_refuses_bad_requests(table):
    source = EmbeddingSource(table, device="cpu", resident_bytes=1000 * table.row_bytes,
                             max_tokens=4)
    with pytest.raises(IndexError, match=f"row id {table.num_rows} is outside"):
        source(torch.tensor([0] * 15 + [table.num_rows]))
    with pytest.raises(ValueError, match="not a whole number of tokens"):
        source(torch.arange(17))
    with pytest.raises(ValueError, match="exceed max_tokens"):
        source(torch.zeros((5, 16), dtype=torch.int64))


@needs_cuda
def test_torch_source_output_feeds_a_captured_cuda_graph(table):
    source = EmbeddingSource(table, device="cuda", resident_bytes=2000 * table.row_bytes,
                             max_tokens=128)
    first = token_ids(table, 128, 7)
    source(torch.from_numpy(first).cuda())
    seen = torch.empty((128, 16 * table.values_per_row), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            # A stand-in for the model layer: reads the stable output buffer.
            seen.copy_(source.output.view(128, -1))
    torch.cuda.current_stream().wait_stream(stream)
    second = token_ids(table, 128, 8)
    source(torch.from_numpy(second).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(bits(seen), expected_bits(table, second))
