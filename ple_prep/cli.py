"""The `ple-prep` command: parses options, calls the library, prints. Nothing else lives here.

Exit codes: 0 ok, 1 a check failed, 2 bad input (one line `error: ...` on stderr).
"""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from . import __version__
from .constants import GGUF_FIXTURE_VARIANTS
from .errors import BadInput, CheckFailed


class _Group(click.Group):
    """Maps library errors and usage errors to one line on stderr and the documented exit codes."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("standalone_mode", None)
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except (click.ClickException, BadInput) as exc:
            message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
            click.echo(f"error: {message}", err=True)
            sys.exit(2)
        except CheckFailed as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except (click.Abort, KeyboardInterrupt):
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            click.echo(f"error: {exc.strerror or exc}{where}", err=True)
            sys.exit(2)


def json_option(command: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(command)


class _ModelPath(click.ParamType):
    """A checkpoint folder, or a model name resolved offline from the Hugging Face cache (hub.py)."""

    name = "PATH|NAME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from .hub import resolve_model

        return resolve_model(value)


def model_option(help: str = "Source checkpoint.", required: bool = True) -> Callable[[Callable], Callable]:
    """The one --model option of every command that reads a checkpoint: a path or a cached model name."""
    return click.option(
        "--model", "model", required=required, type=_ModelPath(),
        help=f"{help} A folder or file, or a model name from the Hugging Face cache: OWNER/NAME "
             "or NAME, then optionally @REVISION and :QUANT for a GGUF file (offline; HF_HUB_CACHE "
             "and HF_HOME are respected).")


def quiet_option(command: Callable) -> Callable:
    return click.option("--quiet", "-q", is_flag=True, help="No progress bars and no text summary; --json output and errors still print.")(command)


@contextlib.contextmanager
def progress_bar(total: int, description: str, quiet: bool, unit: str = "B") -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr; off with --quiet or when stderr is not a terminal."""
    from tqdm import tqdm

    with tqdm(total=total, desc=description, unit=unit, unit_scale=True, unit_divisor=1024 if unit == "B" else 1000,
              disable=True if quiet else None, file=sys.stderr, leave=False) as bar:
        yield bar.update


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="ple-prep")
def cli() -> None:
    """Prepare the n-gram PLE table of Qwen3.8-Flash-Next for serving from fast storage.

    \b
    Example:
        ple-prep demo
        ple-prep convert --model Qwen/Qwen3.8-Flash-Next-FP8 --out /nvme/ple.bin

    \b
    Exit status: 0 ok, 1 a check failed (verify), 2 bad input (one line
    "error: ..." on stderr, nothing left behind), 130 interrupted.
    --model takes a folder or a model name found offline in the Hugging Face
    cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).
    --json prints machine-readable output on stdout; progress bars go to
    stderr and switch off when it is not a terminal or with --quiet.
    """


@cli.command()
@model_option("Checkpoint to convert.")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Prepared table to write; the manifest goes to OUT.json.")
@click.option("--page-size", default=4096, show_default=True, help="Page size in bytes.")
@click.option("--force", is_flag=True, help="Replace an existing table.")
@click.option("--tp-size", type=click.IntRange(min=1),
              help="Split for T tensor-parallel ranks: one file per rank, OUT with .tp{r}of{T} "
                   "before its suffix (rank r owns rows [r*P, (r+1)*P), P = rows/T).")
@click.option("--tp-rank", type=click.IntRange(min=0), help="With --tp-size: write only this rank's file.")
@json_option
@quiet_option
def convert(model: Path, out: Path, page_size: int, force: bool, tp_size: int | None,
            tp_rank: int | None, as_json: bool, quiet: bool) -> None:
    """Rewrite the table of a checkpoint into one page-aligned prepared file (or one per TP rank).

    \b
    Example:
        ple-prep convert --model ./Qwen3.8-Flash-Next-FP8 --out /nvme/ple.bin
        ple-prep convert --model ./Qwen3.8-Flash-Next-FP8 --out /nvme/ple.bin --tp-size 2
    """
    from .converters import open_source
    from .layouts.writer import convert as write_table

    if tp_rank is not None and tp_size is None:
        raise BadInput("--tp-rank needs --tp-size")
    started = time.perf_counter()
    if tp_size is not None:
        _convert_ranks(model, out, page_size, force, tp_size, tp_rank, as_json, quiet)
        return
    with open_source(model) as source:
        with progress_bar(source.num_rows * source.row_bytes, "convert", quiet) as advance:
            manifest = write_table(source, out, page_size=page_size, force=force, progress=advance)
    seconds = time.perf_counter() - started
    summary = {"out": str(out), "rows": manifest["num_rows"], "encoding": manifest["encoding"],
               "file_size": manifest["file_size"], "seconds": round(seconds, 3)}
    if as_json:
        echo_json(summary)
    elif not quiet:
        click.echo(f"wrote {out}: {summary['rows']:,} {summary['encoding']} rows, "
                   f"{summary['file_size'] / 2**20:.1f} MiB in {seconds:.1f} s")


def _convert_ranks(model: Path, out: Path, page_size: int, force: bool, tp_size: int,
                   tp_rank: int | None, as_json: bool, quiet: bool) -> None:
    from .converters import open_source
    from .layouts.ranks import convert_ranks

    started = time.perf_counter()
    ranks = None if tp_rank is None else [tp_rank]
    with open_source(model) as source:
        rows = source.num_rows if ranks is None else source.num_rows // tp_size
        with progress_bar(rows * source.row_bytes, "convert", quiet) as advance:
            written = convert_ranks(source, out, tp_size, ranks, page_size=page_size, force=force,
                                    progress=advance)
    seconds = time.perf_counter() - started
    files = [{"out": str(path), "tp_rank": m["tensor_parallel"]["rank"], "first_row": m["first_row"],
              "rows": m["num_rows"], "file_size": m["file_size"]} for path, m in written]
    if as_json:
        echo_json({"tp_size": tp_size, "files": files, "encoding": written[0][1]["encoding"],
                   "seconds": round(seconds, 3)})
    elif not quiet:
        for entry in files:
            click.echo(f"wrote {entry['out']}: rank {entry['tp_rank']} of {tp_size}, rows "
                       f"{entry['first_row']:,} to {entry['first_row'] + entry['rows']:,}, "
                       f"{entry['file_size'] / 2**20:.1f} MiB")
        click.echo(f"{len(files)} file(s) in {seconds:.1f} s")


@cli.command()
@click.argument("table", type=click.Path(path_type=Path))
@model_option("Source checkpoint to compare every row with.", required=False)
@click.option("--sample", type=click.IntRange(min=1), help="Compare N random rows instead of all.")
@click.option("--seed", default=0, show_default=True, help="Seed of the sample.")
@json_option
@quiet_option
def verify(table: Path, model: Path | None, sample: int | None, seed: int, as_json: bool,
           quiet: bool) -> None:
    """Check the checksums, and with --model every row byte for byte; exit 1 on a difference.

    \b
    Example:
        ple-prep verify /nvme/ple.bin --model ./Qwen3.8-Flash-Next-FP8 --sample 100000
    """
    from .layouts.manifest import load_manifest, manifest_path
    from .verify import verify as verify_table

    manifest = load_manifest(manifest_path(table))
    total = manifest["file_size"] + (manifest["num_rows"] * manifest["row_bytes"] if model else 0)
    with progress_bar(total, "verify", quiet) as advance:
        report = verify_table(table, model, sample=sample, seed=seed, progress=advance)
    if as_json:
        echo_json(report.to_json())
    elif not quiet:
        click.echo(f"checksums: {report.checksum_blocks} blocks, "
                   f"{len(report.bad_blocks)} bad, header {'ok' if report.header_ok else 'BAD'}")
        for block in report.bad_blocks:
            click.echo(f"  block {block['block']} (bytes {block['bytes'][0]}-{block['bytes'][1]}): "
                       f"{block['num_rows']} rows, first {block['first_rows']}")
        if model is not None:
            click.echo(f"rows: {report.rows_compared:,} compared, {report.mismatched_rows:,} differ"
                       + (f", first {report.first_mismatches}" if report.first_mismatches else ""))
        for problem in report.source_problems:
            click.echo(f"source: {problem}")
        for problem in report.file_problems:
            click.echo(f"file: {problem}")
    if not report.ok:
        raise CheckFailed(f"{table} does not match"
                          + (f": rows {report.first_mismatches} differ" if report.first_mismatches else ""))


@cli.command()
@click.argument("table", type=click.Path(path_type=Path))
@json_option
def inspect(table: Path, as_json: bool) -> None:
    """Print a prepared table's manifest.

    \b
    Example:
        ple-prep inspect /nvme/ple.bin --json
    """
    from .layouts.manifest import load_manifest, manifest_path

    manifest = load_manifest(manifest_path(table))
    if as_json:
        echo_json(manifest)
        return
    scale = manifest["scale"]
    scale_text = "none" if scale is None else f"{scale['value']!r} ({scale['dtype']} 0x{scale['hex']})"
    lines = [
        f"table:      {table} ({manifest['file_size']:,} bytes, format v{manifest['format_version']})",
        f"encoding:   {manifest['encoding']}, {manifest['values_per_row']} values in "
        f"{manifest['row_bytes']} bytes a row, {manifest['rows_per_page']} rows a "
        f"{manifest['page_size']}-byte page",
        f"rows:       {manifest['num_rows']:,} (global {manifest['first_row']:,} to "
        f"{manifest['first_row'] + manifest['num_rows']:,} of {manifest['total_rows']:,})",
        f"scale:      {scale_text}",
        *([f"tp rank:    {manifest['tensor_parallel']['rank']} of {manifest['tensor_parallel']['size']}"]
          if manifest.get("tensor_parallel") else []),
        f"source:     {manifest['source']['format']} {manifest['source'].get('model', '')}",
        f"layout:     {manifest['layout']['kind']}, {manifest['layout']['num_placed']:,} rows placed first",
        f"checksums:  {len(manifest['checksums']['blocks'])} crc32 blocks of "
        f"{manifest['checksums']['block_bytes'] // 2**20} MiB",
        f"file id:    {manifest['file_id']} (ple-prep {manifest['tool_version']})",
    ]
    click.echo("\n".join(lines))


@cli.command("make-fixture")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--variant", type=click.Choice(["fp8", "bf16", "nvfp4", *GGUF_FIXTURE_VARIANTS]),
              default="fp8", show_default=True,
              help="safetensors checkpoint (fp8, bf16, nvfp4) or GGUF model (gguf-TYPE).")
@click.option("--base", default=1000, show_default=True, help="ngram_vocab_size_base.")
@click.option("--shards", default=128, show_default=True, help="split_ngram_parts.")
@click.option("--gguf-layout", type=click.Choice(["joined", "split"]), default="joined",
              show_default=True, help="GGUF: one joined table tensor or 16 head tensors.")
@click.option("--gguf-files", type=click.IntRange(min=1), default=1, show_default=True,
              help="GGUF: split into NAME-0000k-of-0000N.gguf files.")
@click.option("--seed", default=0, show_default=True)
def make_fixture(out: Path, variant: str, base: int, shards: int, gguf_layout: str,
                 gguf_files: int, seed: int) -> None:
    """Write a small checkpoint in the model's real layout.

    \b
    Example:
        ple-prep make-fixture ./tiny-fp8 --variant fp8
        ple-prep make-fixture ./tiny-iq4 --variant gguf-iq4_nl --gguf-layout split --gguf-files 3
    """
    if variant.startswith("gguf-"):
        from .fixtures import make_gguf

        make_gguf(out, variant.removeprefix("gguf-"), layout=gguf_layout, num_files=gguf_files,
                  base=base, seed=seed)
        click.echo(f"wrote {variant} {gguf_layout} model to {out}")
        return
    from .fixtures import make_checkpoint

    make_checkpoint(out, variant, base=base, num_shards=shards, seed=seed)
    click.echo(f"wrote {variant} checkpoint to {out}")


@cli.command()
@click.option("--dir", "folder", type=click.Path(path_type=Path),
              help="Keep the files here instead of a temporary folder.")
@click.option("--variant", type=click.Choice(["fp8", "bf16", "nvfp4"]), default="fp8",
              show_default=True)
@json_option
@quiet_option
def demo(folder: Path | None, variant: str, as_json: bool, quiet: bool) -> None:
    """Build the example checkpoint, convert it, verify it, and read rows back.

    \b
    Example:
        ple-prep demo
    """
    from .demo import run_demo

    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ple-prep-demo-")))
        summary = run_demo(folder, variant)
    if as_json:
        echo_json(summary)
    elif not quiet:
        click.echo("\n".join(f"{key}: {value}" for key, value in summary.items()))
    if not summary["verified"]:
        raise CheckFailed("the demo table does not match its source")


if __name__ == "__main__":
    cli()
