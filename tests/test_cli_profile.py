"""CLI: ple-prep profile, profile merge, convert --profile, inspect's residency curve."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from support.refusal import assert_refused

from ple_prep.cli import cli
from ple_prep.offline.profile import load_profile


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-prompts")
    with open(folder / "chats.jsonl", "w") as handle:
        for i in range(300):
            messages = [{"role": "user", "content": f"read row {i % 37} of the table"}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    (folder / "doc.txt").write_text("the model reads the table from fast storage. " * 20)
    np.save(folder / "ids.npy", np.random.default_rng(0).integers(0, 2000, size=5000))
    return folder


def test_profile_writes_a_profile_and_reports_json(runner, fp8_checkpoint, prompts, tmp_path):
    out = tmp_path / "p.prof"
    result = runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts",
                                 str(prompts / "chats.jsonl"), str(prompts / "doc.txt"),
                                 "--out", str(out), "--json", "--quiet"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] == 301 and summary["inputs"] == 2
    assert summary["train"]["requests"] + summary["heldout"]["requests"] == 301
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == ["p.prof"]


def test_profile_merge_equals_one_run(runner, fp8_checkpoint, prompts, tmp_path):
    files = [str(prompts / n) for n in ("chats.jsonl", "doc.txt", "ids.npy")]
    model = ["--model", str(fp8_checkpoint), "-q"]
    assert runner.invoke(cli, ["profile", *model, "--prompts", *files,
                               "--out", str(tmp_path / "all.prof")]).exit_code == 0
    assert runner.invoke(cli, ["profile", *model, "--prompts", files[0], "--prompts", files[1],
                               "--out", str(tmp_path / "a.prof")]).exit_code == 0
    assert runner.invoke(cli, ["profile", *model, "--prompts", files[2],
                               "--out", str(tmp_path / "b.prof")]).exit_code == 0
    result = runner.invoke(cli, ["profile", "merge", str(tmp_path / "a.prof"), str(tmp_path / "b.prof"),
                                 "-o", str(tmp_path / "merged.prof")])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("wrote ")
    assert (tmp_path / "merged.prof").read_bytes() == (tmp_path / "all.prof").read_bytes()


@pytest.mark.parametrize("args, message", [
    (["--prompts", "MISSING.txt"], "error: prompt file not found: "),
    (["--prompts", "BAD.jsonl"], "error: "),
    ([], "error: give prompt files with --prompts"),
])
def test_profile_bad_input_exits_2_and_leaves_nothing(runner, fp8_checkpoint, tmp_path, args, message):
    (tmp_path / "BAD.jsonl").write_text('{"text": "ok"}\n{"token_ids": [-1]}\n')
    args = [a.replace("MISSING.txt", str(tmp_path / "missing.txt")).replace("BAD.jsonl", str(tmp_path / "BAD.jsonl"))
            for a in args]
    result = runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), *args,
                                 "--out", str(tmp_path / "p.prof"), "-q"])
    assert result.exit_code == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BAD.jsonl"]


def test_profile_merge_bad_input_exits_2(runner, tmp_path):
    (tmp_path / "x.prof").write_text("nope")
    result = runner.invoke(cli, ["profile", "merge", str(tmp_path / "x.prof"), "-o", str(tmp_path / "m.prof")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    assert not (tmp_path / "m.prof").exists()


def test_profile_help_has_examples(runner):
    for args in (["profile", "--help"], ["profile", "merge", "--help"], ["profile", "run", "--help"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0 and "Example:" in result.output


def test_convert_profile_and_inspect_show_residency(runner, fp8_checkpoint, prompts, tmp_path):
    profile = tmp_path / "p.prof"
    runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompts / "chats.jsonl"),
                        str(prompts / "ids.npy"), "--out", str(profile), "-q"])
    table = tmp_path / "t.bin"
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--profile", str(profile),
                                 "--out", str(table), "--map-fraction", "0.015", "-q", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(runner.invoke(cli, ["inspect", str(table), "--json"]).stdout)
    assert manifest["layout"]["kind"] == "access-ordered" and manifest["layout"]["num_placed"] > 0
    assert len(manifest["residency"]) == 12
    text = runner.invoke(cli, ["inspect", str(table)]).stdout
    assert "access-ordered" in text and "held-out hits" in text
    assert f"{manifest['residency'][7]['hit_fraction']:.2%}" in text
    verified = runner.invoke(cli, ["verify", str(table), "--model", str(fp8_checkpoint), "-q"])
    assert verified.exit_code == 0, verified.output


def test_convert_profile_refuses_bad_map_fraction_and_other_model(runner, fp8_checkpoint, prompts, tmp_path):
    from ple_prep.tools.fixtures import make_checkpoint

    other = make_checkpoint(tmp_path / "other", base=2000, num_shards=4)
    profile = tmp_path / "p.prof"
    runner.invoke(cli, ["profile", "--model", str(other), "--prompts", str(prompts / "doc.txt"), "--out", str(profile)])
    for extra, message in ((["--map-fraction", "0.05"], "below 2%"), ([], "another model")):
        result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--profile", str(profile),
                                     "--out", str(tmp_path / "t.bin"), "-q", *extra])
        assert result.exit_code == 2 and message in result.stderr
        assert not (tmp_path / "t.bin").exists()


def test_inspect_plot_draws_png_or_says_why_not(runner, fp8_checkpoint, prompts, tmp_path, monkeypatch):
    profile, table = tmp_path / "p.prof", tmp_path / "t.bin"
    runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompts / "chats.jsonl"),
                        str(prompts / "ids.npy"), "--out", str(profile), "-q"])
    runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--profile", str(profile),
                        "--out", str(table), "-q"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        matplotlib = None
    if matplotlib is not None:
        result = runner.invoke(cli, ["inspect", str(table), "--plot", str(tmp_path / "curve.png")])
        assert result.exit_code == 0, result.output
        assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = runner.invoke(cli, ["inspect", str(table), "--plot", str(tmp_path / "other.png")])
    assert result.exit_code == 2 and result.stderr == "error: --plot needs matplotlib: pip install 'ple-prep[plot]'\n"


def test_inspect_plot_without_hints_exits_2(runner, fp8_checkpoint, tmp_path):
    table = tmp_path / "t.bin"
    runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--out", str(table), "-q"])
    assert "no hints" in runner.invoke(cli, ["inspect", str(table)]).stdout
    pytest.importorskip("matplotlib")
    result = runner.invoke(cli, ["inspect", str(table), "--plot", str(tmp_path / "c.png")])
    assert result.exit_code == 2 and "no measured residency hints" in result.stderr


def test_convert_profile_per_tp_rank_keeps_global_ids(runner, fp8_checkpoint, prompts, tmp_path):
    from ple_prep.converters import open_source
    from ple_prep.runtime import open_table

    profile = tmp_path / "p.prof"
    runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompts / "chats.jsonl"),
                        str(prompts / "ids.npy"), "--out", str(profile), "-q"])
    result = runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--profile", str(profile),
                                 "--map-fraction", "0.015", "--tp-size", "2", "--out", str(tmp_path / "t.bin"), "-q"])
    assert result.exit_code == 0, result.output
    with open_source(fp8_checkpoint) as source:
        expected = source.read_rows(0, source.num_rows)
    for rank in range(2):
        with open_table(tmp_path / f"t.tp{rank}of2.bin") as table:
            assert table.manifest["layout"]["kind"] == "access-ordered" and table.order.num_placed > 0
            assert len(table.manifest["residency"]) == 12
            first, stop = table.row_range
            ids = np.random.default_rng(rank).permutation(np.arange(first, stop))
            assert np.array_equal(table.gather(ids), expected[ids])
            assert np.array_equal(np.sort(table.slot_of(ids)), np.arange(stop - first))


def test_profile_needs_only_the_config_and_the_tokenizer(runner, fp8_checkpoint, prompts, tmp_path):
    # Traffic can be profiled before the weights are downloaded: the hash needs config.json alone.
    light = tmp_path / "config-and-tokenizer"
    light.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (light / name).write_bytes((fp8_checkpoint / name).read_bytes())
    files = [str(prompts / "chats.jsonl"), str(prompts / "doc.txt")]
    for model, out in ((light, tmp_path / "light.prof"), (fp8_checkpoint, tmp_path / "full.prof")):
        result = runner.invoke(cli, ["profile", "--model", str(model), "--prompts", *files,
                                     "--out", str(out), "-q"])
        assert result.exit_code == 0, result.output
    light_profile, full_profile = load_profile(tmp_path / "light.prof"), load_profile(tmp_path / "full.prof")
    assert light_profile.spec == full_profile.spec
    assert light_profile.summary() == full_profile.summary()
    for part in ("train", "heldout"):
        for order, (keys, counts) in full_profile.parts[part].groups.items():
            assert np.array_equal(light_profile.parts[part].groups[order][0], keys)
            assert np.array_equal(light_profile.parts[part].groups[order][1], counts)


def test_profile_merge_refuses_a_profile_given_twice(runner, fp8_checkpoint, prompts, tmp_path):
    one = tmp_path / "one.prof"
    assert runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts",
                               str(prompts / "doc.txt"), "--out", str(one), "-q"]).exit_code == 0
    copy = tmp_path / "copy.prof"
    copy.write_bytes(one.read_bytes())
    for pair in ((one, one), (one, copy)):
        result = runner.invoke(cli, ["profile", "merge", *map(str, pair), "-o", str(tmp_path / "m.prof")])
        assert result.exit_code == 2, result.output
        assert "both counted doc.txt" in result.stderr and "twice" in result.stderr
        assert not (tmp_path / "m.prof").exists()


def test_plot_labels_stay_inside_the_axes(runner, fp8_checkpoint, prompts, tmp_path):
    pytest.importorskip("matplotlib")
    from ple_prep.format.manifest import load_table_manifest
    from ple_prep.tools.plot import residency_figure

    profile, table = tmp_path / "p.prof", tmp_path / "t.bin"
    runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompts / "chats.jsonl"),
                        str(prompts / "ids.npy"), "--out", str(profile), "-q"])
    runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--profile", str(profile),
                        "--out", str(table), "-q"])
    figure = residency_figure(load_table_manifest(table), "t.bin")
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[0]
    box = axes.get_window_extent(renderer)
    labels = axes.texts
    assert len(labels) >= 2
    for label in labels:
        extent = label.get_window_extent(renderer)
        assert (box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1 and box.y0 - 1 <= extent.y0
                and extent.y1 <= box.y1 + 1), (label.get_text(), extent, box)


def test_inspect_plot_never_replaces_the_table_or_its_manifest_and_needs_force_over_a_file(
        runner, fp8_checkpoint, prompts, tmp_path):
    pytest.importorskip("matplotlib")
    profile, table = tmp_path / "p.prof", tmp_path / "t.bin"
    runner.invoke(cli, ["profile", "--model", str(fp8_checkpoint), "--prompts", str(prompts / "chats.jsonl"),
                        "--out", str(profile), "-q"])
    runner.invoke(cli, ["convert", "--model", str(fp8_checkpoint), "--profile", str(profile),
                        "--out", str(table), "-q"])
    notes = tmp_path / "config.json"
    notes.write_text("{}")
    files = sorted(p.name for p in tmp_path.iterdir())
    before = {name: (tmp_path / name).read_bytes() for name in files}
    for target in (table, tmp_path / "t.bin.json"):
        for force in ([], ["--force"]):
            result = runner.invoke(cli, ["inspect", str(table), "--plot", str(target), *force])
            assert_refused(result, tmp_path, f"{target} is {target}, an input of this command",
                           left=files)
    assert_refused(runner.invoke(cli, ["inspect", str(table), "--plot", str(notes)]), tmp_path,
                   f"{notes} exists; pass --force", left=files)
    assert_refused(runner.invoke(cli, ["inspect", str(table), "--plot", str(tmp_path)]), tmp_path,
                   f"{tmp_path} is a folder; give a file name", left=files)
    assert {name: (tmp_path / name).read_bytes() for name in files} == before
    result = runner.invoke(cli, ["inspect", str(table), "--plot", str(notes), "--force"])
    assert result.exit_code == 0, result.output
    assert notes.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
