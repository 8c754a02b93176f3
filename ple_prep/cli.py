"""The `ple-prep` command: parses options, calls the library, prints. Nothing else lives here.

Exit codes: 0 ok, 1 a check failed, 2 bad input (one line `error: ...` on stderr), 70 a bug (an
exception nobody expected: one line naming it, the traceback with --debug or PLE_PREP_DEBUG=1).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from . import __version__
from .core.constants import DEFAULT_MAP_FRACTION, DEFAULT_PAGE_SIZE, GGUF_FIXTURE_VARIANTS
from .core.errors import BadInput, CheckFailed

EXIT_BUG = 70  # EX_SOFTWARE of sysexits.h: an internal software error
DEBUG_VARIABLE = "PLE_PREP_DEBUG"
# click 8.2 and later raise this for a bare group (click 8.1 printed the help and exited 0 itself).
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _report_bug(exc: BaseException, debug: bool) -> None:
    """One line naming an unexpected exception and where it was raised; the traceback when debugging."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    message = " ".join(str(exc).split())[:200]
    click.echo(f"error: internal error, a bug in ple-prep {__version__}: {type(exc).__name__}"
               f"{f': {message}' if message else ''}{where}. Please report it to the ple-prep issue "
               f"tracker with the command you ran"
               + ("" if debug else f" and the traceback that --debug (or {DEBUG_VARIABLE}=1) prints"), err=True)


class _Group(click.Group):
    """Maps library errors and usage errors to one line on stderr and the documented exit codes."""

    debug = False

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("standalone_mode", None)
        # open_table's warning that the compiled helper is missing (runtime/compiled.py) is for serving
        # processes: `bench` says it in its report, where a warning's source line would only be noise.
        warnings.filterwarnings("ignore", message="ple-prep's compiled helper is not built")
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except _NO_ARGS_IS_HELP as exc:
            # A bare `ple-prep` asks what there is: the help, not an error.
            click.echo(exc.ctx.get_help())
            sys.exit(0)
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
        except Exception as exc:
            _report_bug(exc, _Group.debug or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"))
            sys.exit(EXIT_BUG)


def json_option(command: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(command)


class _ModelPath(click.ParamType):
    """A checkpoint folder, or a model name resolved offline from the Hugging Face cache (hub.py)."""

    name = "PATH|NAME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from .converters.hub import resolve_model

        return resolve_model(value)


def model_option(help: str = "Source checkpoint.", required: bool = True) -> Callable[[Callable], Callable]:
    """The one --model option of every command that reads a checkpoint: a path or a cached model name."""
    return click.option(
        "--model", "model", required=required, type=_ModelPath(),
        help=f"{help} A folder or file, or a model name from the Hugging Face cache: OWNER/NAME "
             "or NAME, then optionally @REVISION and :QUANT for a GGUF file (offline; HF_HUB_CACHE "
             "and HF_HOME are respected).")


def quiet_option(command: Callable, prints: str = "--json output and errors") -> Callable:
    return click.option("--quiet", "-q", is_flag=True,
                        help=f"No progress bars and no text summary; {prints} still print.")(command)


@contextlib.contextmanager
def progress_bar(total: int, description: str, quiet: bool, unit: str = "B") -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr; off with --quiet or when stderr is not a terminal."""
    from tqdm import tqdm

    with tqdm(total=total or None, desc=description, unit=unit, unit_scale=True,
              unit_divisor=1024 if unit == "B" else 1000, disable=True if quiet else None, file=sys.stderr,
              leave=False) as bar:
        yield bar.update


def _count(number: int, noun: str) -> str:
    """'1 block', '3 blocks'."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps a whole part: '2.64 MiB', '47.68 GiB', '512 bytes'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.2f} {unit}"
    return f"{nbytes} bytes"


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="ple-prep")
@click.option("--debug", is_flag=True, help=f"On a bug (exit {EXIT_BUG}), print the traceback too "
              f"(also {DEBUG_VARIABLE}=1).")
def cli(debug: bool) -> None:
    """Prepare the n-gram PLE table of Qwen3.8-Flash-Next for serving from fast storage.

    \b
    Example:
        ple-prep demo
        ple-prep convert --model Qwen/Qwen3.8-Flash-Next-FP8 --out /nvme/ple.bin

    \b
    Exit status: 0 ok, 1 a check failed (verify), 2 bad input (one line
    "error: ..." on stderr, nothing left behind), 70 a bug in ple-prep (one
    line naming it; --debug or PLE_PREP_DEBUG=1 adds the traceback, to
    report), 130 interrupted.
    --model takes a folder or a model name found offline in the Hugging Face
    cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).
    --json prints machine-readable output on stdout; progress bars go to
    stderr and switch off when it is not a terminal or with --quiet.
    """
    _Group.debug = debug


@cli.command()
@model_option("Checkpoint to convert.")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Prepared table to write; the manifest goes to OUT.json.")
@click.option("--page-size", default=DEFAULT_PAGE_SIZE, show_default=True, help="Page size in bytes.")
@click.option("--profile", "profile_path", type=click.Path(path_type=Path),
              help="Profile (ple-prep profile) to lay the rows out by access; hints go to the manifest.")
@click.option("--map-fraction", default=DEFAULT_MAP_FRACTION, show_default=True, type=float,
              help="With --profile: most RAM the row-order map may cost, as a fraction of the table.")
@click.option("--force", is_flag=True, help="Replace an existing table.")
@click.option("--tp-size", type=click.IntRange(min=1),
              help="Split for T tensor-parallel ranks: one file per rank, OUT with .tp{r}of{T} "
                   "before its suffix (rank r owns rows [r*P, (r+1)*P), P = rows/T). Each rank's file "
                   "is published as soon as it is written: an interrupted run keeps the ranks it finished.")
@click.option("--tp-rank", type=click.IntRange(min=0), help="With --tp-size: write only this rank's file.")
@click.option("--resume", is_flag=True,
              help="Continue a killed convert of OUT: keep the blocks it wrote that re-verify, "
                   "write the rest (a run of other options or another source, or any run with "
                   "--profile, starts afresh).")
@json_option
@quiet_option
def convert(model: Path, out: Path, page_size: int, profile_path: Path | None, map_fraction: float,
            force: bool, tp_size: int | None, tp_rank: int | None, resume: bool, as_json: bool,
            quiet: bool) -> None:
    """Rewrite the table of a checkpoint into one page-aligned prepared file (or one per TP rank).

    With --profile, rows are laid out by access (hottest n-grams first, each n-gram's rows on one
    page) and the manifest gets residency hints measured on the profile's held-out requests.

    \b
    Example:
        ple-prep convert --model ./Qwen3.8-Flash-Next-FP8 --out /nvme/ple.bin
        ple-prep convert --model ./Qwen3.8-Flash-Next-FP8 --out /nvme/ple.bin --tp-size 2
        ple-prep convert --model ./Qwen3.8-Flash-Next-FP8 --profile chats.prof --out /nvme/ple.bin
    """
    from .converters import open_source
    from .offline.ranks import convert_ranks
    from .offline.writer import WriteOptions, bound_heap
    from .offline.writer import convert as write_table

    if tp_rank is not None and tp_size is None:
        raise BadInput("--tp-rank needs --tp-size")
    started = time.perf_counter()
    bound_heap()
    profile = None
    if profile_path is not None:
        from .offline.planner import check_map_fraction, plan_for_source
        from .offline.profile import load_profile

        check_map_fraction(map_fraction)
        # Checked whole before the source is opened; the planner reads it again a part at a time.
        profile = profile_path
        load_profile(profile_path, parts=())
    options = WriteOptions(page_size=page_size, force=force, resume=resume)
    with open_source(model) as source:
        def layout_for(first_row: int, num_rows: int) -> Any:
            if profile is None:
                return None
            return plan_for_source(source, profile, page_size=page_size, map_fraction=map_fraction,
                                   first_row=first_row, num_rows=num_rows)

        rows = source.num_rows if tp_size is None or tp_rank is None else source.num_rows // tp_size
        with progress_bar(rows * source.row_bytes, "convert", quiet) as advance:
            if tp_size is None:
                # The plan runs inside the writer, which reads and hashes the source meanwhile.
                plan = None if profile is None else functools.partial(layout_for, 0, source.num_rows)
                written = [(out, write_table(source, out, options, plan=plan, progress=advance))]
            else:
                written = convert_ranks(source, out, tp_size, None if tp_rank is None else [tp_rank], options,
                                        progress=advance, layout_for=layout_for)
    _print_written(written, tp_size, time.perf_counter() - started, as_json, quiet)


def _print_written(written: list[tuple[Path, dict[str, Any]]], tp_size: int | None, seconds: float,
                   as_json: bool, quiet: bool) -> None:
    """convert's summary: one table, or one file per tensor-parallel rank."""
    if tp_size is None:
        out, manifest = written[0]
        summary = {"out": str(out), "rows": manifest["num_rows"], "encoding": manifest["encoding"],
                   "file_size": manifest["file_size"], "seconds": round(seconds, 3)}
        if as_json:
            echo_json(summary)
        elif not quiet:
            click.echo(f"wrote {out}: {summary['rows']:,} {summary['encoding']} rows, "
                       f"{_size(summary['file_size'])} in {seconds:.1f} s")
        return
    files = [{"out": str(path), "tp_rank": m["tensor_parallel"]["rank"], "first_row": m["first_row"],
              "rows": m["num_rows"], "file_size": m["file_size"]} for path, m in written]
    if as_json:
        echo_json({"tp_size": tp_size, "files": files, "encoding": written[0][1]["encoding"],
                   "seconds": round(seconds, 3)})
    elif not quiet:
        for entry in files:
            click.echo(f"wrote {entry['out']}: rank {entry['tp_rank']} of {tp_size}, rows "
                       f"{entry['first_row']:,} to {entry['first_row'] + entry['rows']:,}, "
                       f"{_size(entry['file_size'])}")
        click.echo(f"{len(files)} file{'s' if len(files) != 1 else ''} in {seconds:.1f} s")


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
    from .format.manifest import load_table_manifest
    from .offline.verify import verify as verify_table

    manifest = load_table_manifest(table)
    total = manifest["file_size"] + (manifest["num_rows"] * manifest["row_bytes"] if model else 0)
    with progress_bar(total, "verify", quiet) as advance:
        report = verify_table(table, model, sample=sample, seed=seed, progress=advance)
    if as_json:
        echo_json(report.to_json())
    elif not quiet:
        click.echo(f"checksums: {_count(report.checksum_blocks, 'block')}, "
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
    if report.converted_from is not None:
        raise CheckFailed(f"{table} was converted from {report.converted_from}, not from {model}: "
                          f"give that checkpoint to --model (or convert {model} again)")
    if not report.ok:
        raise CheckFailed(f"{table} does not match"
                          + (f": rows {report.first_mismatches} differ" if report.first_mismatches else ""))


@cli.command()
@click.argument("table", type=click.Path(path_type=Path))
@functools.partial(quiet_option, prints="errors")
def pagesums(table: Path, quiet: bool) -> None:
    """Write the page sums that open_table(verify_reads=True) checks disk reads against.

    Reads the whole table once; the sums are written (TABLE.pagesums, beside it) only if every
    block matches the manifest's checksums.

    \b
    Example:
        ple-prep pagesums /nvme/ple.bin
    """
    from .format.manifest import load_table_manifest
    from .offline.pagesums import write_page_sums

    manifest = load_table_manifest(table)
    with progress_bar(manifest["file_size"] - manifest["data_offset"], "pagesums", quiet) as advance:
        written = write_page_sums(table, advance)
    if not quiet:
        pages = (manifest["file_size"] - manifest["data_offset"]) // manifest["page_size"]
        click.echo(f"wrote {written}: {_count(pages, 'page')}")


@cli.command()
@click.argument("table", type=click.Path(path_type=Path))
@click.option("--plot", "plot_path", type=click.Path(path_type=Path),
              help="Draw the residency curve to this PNG (needs matplotlib: the 'plot' extra).")
@click.option("--force", is_flag=True, help="Replace an existing --plot file.")
@json_option
def inspect(table: Path, plot_path: Path | None, force: bool, as_json: bool) -> None:
    """Print a prepared table's manifest, and its residency curve when it has one.

    \b
    Example:
        ple-prep inspect /nvme/ple.bin --json
        ple-prep inspect /nvme/ple.bin --plot residency.png
    """
    from .format.manifest import load_table_manifest, manifest_path, validate_with_schema
    from .runtime import open_table

    manifest = load_table_manifest(table)
    validate_with_schema(manifest, manifest_path(table).name)
    # The file and its manifest must be one conversion's, as verify and open_table require.
    open_table(table).close()
    if plot_path is not None:
        from .tools.plot import plot_residency

        plot_residency(manifest, plot_path, title=table.name, force=force,
                       inputs=(table, manifest_path(table)))
    if as_json:
        echo_json(manifest)
        return
    scale = manifest["scale"]
    scale_text = "none" if scale is None else f"{scale['value']!r} ({scale['dtype']} 0x{scale['hex']})"
    lines = [
        f"table:      {table} ({manifest['file_size']:,} bytes, format v{manifest['format_version']})",
        f"encoding:   {manifest['encoding']}"
        + (f" (GGML type {manifest['ggml_type']['name']})" if manifest.get("ggml_type") else "")
        + f", {manifest['values_per_row']} values in "
        f"{manifest['row_bytes']} bytes a row, {manifest['rows_per_page']} rows a "
        f"{manifest['page_size']}-byte page",
        f"rows:       {manifest['num_rows']:,} (global {manifest['first_row']:,} to "
        f"{manifest['first_row'] + manifest['num_rows']:,} of {manifest['total_rows']:,})",
        f"scale:      {scale_text}",
        *([f"tp rank:    {manifest['tensor_parallel']['rank']} of {manifest['tensor_parallel']['size']}"]
          if manifest.get("tensor_parallel") else []),
        f"source:     {manifest['source']['format']} {manifest['source'].get('model', '')}",
        f"layout:     {manifest['layout']['kind']}, {manifest['layout']['num_placed']:,} rows placed first",
        f"checksums:  {_count(len(manifest['checksums']['blocks']), 'crc32 block')} of "
        f"{_size(manifest['checksums']['block_bytes'])}",
        f"file id:    {manifest['file_id']} (ple-prep {manifest['tool_version']})",
    ]
    lines += _residency_lines(manifest)
    if plot_path is not None:
        lines.append(f"plot:       {plot_path}")
    click.echo("\n".join(lines))


def _residency_lines(manifest: dict[str, Any]) -> list[str]:
    """The residency curve as a table: leading rows to keep in RAM and the held-out hits they buy."""
    hints = manifest["residency"]
    if not hints:
        return ["residency:  no hints (convert with --profile to measure them)"]
    lines = ["residency:  budget      resident rows     pages        held-out hits"]
    for hint in hints:
        fraction = hint.get("hit_fraction")
        hits = "n/a (no held-out requests)" if fraction is None else f"{fraction:.2%}"
        lines.append(f"            {hint['budget']:<10}  {hint['rows']:>14,}  {hint['pages']:>11,}  {hits:>12}")
    return lines


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
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--force", is_flag=True, help="Replace an existing fixture folder.")
def make_fixture(out: Path, variant: str, base: int, shards: int, gguf_layout: str,
                 gguf_files: int, seed: int, force: bool) -> None:
    """Write a small checkpoint in the model's real layout into the folder OUT.

    An existing OUT is replaced, whole, only with --force (and only a fixture's folder).

    \b
    Example:
        ple-prep make-fixture ./tiny-fp8 --variant fp8
        ple-prep make-fixture ./tiny-iq4 --variant gguf-iq4_nl --gguf-layout split --gguf-files 3
    """
    from .tools.fixtures import make_fixture as write_fixture

    write_fixture(out, variant, force=force, base=base, num_shards=shards, gguf_layout=gguf_layout,
                  gguf_files=gguf_files, seed=seed)
    if variant.startswith("gguf-"):
        click.echo(f"wrote {variant} {gguf_layout} model to {out}")
    else:
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
    from .tools.demo import run_demo

    temporary = folder is None
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ple-prep-demo-")))
        summary = run_demo(folder, variant)
    if temporary:
        # The files went with their temporary folder: name no path that no longer exists.
        summary["checkpoint"] = summary["table"] = None
    if as_json:
        echo_json(summary)
    elif not quiet:
        lines = [f"{key}: {value}" for key, value in summary.items() if value is not None]
        if temporary:
            lines.append("files: written to a temporary folder and removed (keep them with --dir DIR)")
        click.echo("\n".join(lines))
    if not summary["verified"]:
        raise CheckFailed("the demo table does not match its source")


class _DefaultGroup(click.Group):
    """A group that runs its default command when the first argument is not a command's name."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The default command's options (what `GROUP --option ...` takes), then the commands."""
        default = self.commands[self.default_command]
        records = [param.get_help_record(ctx) for param in default.get_params(ctx)
                   if isinstance(param, click.Option)]
        with formatter.section("Options"):
            formatter.write_dl([record for record in records if record])
        self.format_commands(ctx, formatter)


@cli.group(cls=_DefaultGroup)
def profile() -> None:
    """Count which table rows real prompts read, for an access-ordered layout.

    \b
    ple-prep profile --model DIR --prompts FILE... --out PROFILE [--json] [--quiet]
    ple-prep profile merge A B -o C

    Prompt files: .txt (one request), .jsonl (one request a line: "text", "prompt", chat
    "messages" rendered with the checkpoint's chat template, or "token_ids"), .npy (token ids,
    one request). A tenth of the requests (chosen by content) is held out for residency hints.

    \b
    Example:
        ple-prep profile --model ./Qwen3.8-Flash-Next-FP8 --prompts chats.jsonl docs/*.txt --out p.prof
        ple-prep profile merge shard0.prof shard1.prof -o all.prof
    """


@profile.command("run", hidden=True)
@model_option("Checkpoint whose hash and tokenizer to use.")
@click.option("--prompts", "prompts", multiple=True, type=click.Path(path_type=Path),
              help="Prompt file; more files may follow (--prompts a.jsonl b.txt).")
@click.argument("more_prompts", nargs=-1, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Profile file to write.")
@click.option("--force", is_flag=True, help="Replace an existing profile.")
@click.option("--workers", type=click.IntRange(min=1), metavar="N",
              help="Processes that hash the prompts (default: every core; small inputs use one).")
@json_option
@quiet_option
def profile_run(model: Path, prompts: tuple[Path, ...], more_prompts: tuple[Path, ...], out: Path,
                force: bool, workers: int | None, as_json: bool, quiet: bool) -> None:
    """Profile prompt files through the model's hash.

    \b
    Example:
        ple-prep profile --model ./Qwen3.8-Flash-Next-FP8 --prompts chats.jsonl --out p.prof
    """
    from .offline.profile import check_profile_output, profile_files, save_profile

    files = list(prompts) + list(more_prompts)
    if not files:
        raise BadInput("give prompt files with --prompts")
    check_profile_output(out, force=force, inputs=files, model=model)
    started = time.perf_counter()
    with progress_bar(0, "profile", quiet, unit="tok") as advance:
        result = profile_files(model, files, progress=advance, workers=workers)
    save_profile(result, out, force=force, inputs=files, model=model)
    seconds = time.perf_counter() - started
    summary = {"out": str(out), "seconds": round(seconds, 3), **result.summary()}
    if as_json:
        echo_json(summary)
    elif not quiet:
        click.echo(f"wrote {out}: {summary['requests']:,} requests, {summary['tokens']:,} tokens "
                   f"({summary['heldout']['requests']:,} requests held out) in {seconds:.1f} s")


@profile.command("merge")
@click.argument("profiles", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), help="Merged profile.")
@click.option("--force", is_flag=True, help="Replace an existing profile.")
@json_option
@quiet_option
def profile_merge(profiles: tuple[Path, ...], out: Path, force: bool, as_json: bool, quiet: bool) -> None:
    """Combine profiles of shards of a corpus; the result equals profiling it all at once.

    \b
    Example:
        ple-prep profile merge shard0.prof shard1.prof -o all.prof
    """
    from .offline.profile import check_profile_output, load_profile, merge_profiles, save_profile

    check_profile_output(out, force=force, inputs=profiles)
    merged = merge_profiles([load_profile(path) for path in profiles])
    save_profile(merged, out, force=force, inputs=profiles)
    summary = {"out": str(out), **merged.summary()}
    if as_json:
        echo_json(summary)
    elif not quiet:
        click.echo(f"wrote {out}: {len(profiles)} profiles, {summary['requests']:,} requests, "
                   f"{summary['tokens']:,} tokens")


# --- bench -----------------------------------------------------------------------------------------

_BENCH_ROWS = (("cold_prefill", "cold prefill chunk"), ("cold_decode_16", "cold decode, 1 token"),
               ("warm_prefill", "warm prefill chunk"), ("warm_decode_16", "warm decode, 1 token"),
               ("warm_decode_64", "warm decode, 4 tokens"))


@cli.command()
@click.argument("table", type=click.Path(path_type=Path))
@click.option("--prefill-requests", default=4, show_default=True, type=click.IntRange(min=1),
              help="Cold and warm prefill chunks of 4,096 tokens to time.")
@click.option("--decode-requests", default=500, show_default=True, type=click.IntRange(min=1),
              help="Warm decode steps to time (of 1 and of 4 tokens).")
@click.option("--fio-seconds", default=8.0, show_default=True, type=click.FloatRange(min=0),
              help="Length of fio's random-read run; 0 skips fio.")
@json_option
@quiet_option
def bench(table: Path, prefill_requests: int, decode_requests: int, fio_seconds: float,
          as_json: bool, quiet: bool) -> None:
    """Measure how fast this host's disk serves TABLE: cold and warm gathers of real text.

    Cold requests run after the table is evicted from the page cache; warm ones repeat them. Row
    ids come from real text (the Python standard library's sources) through the table's hash.
    Reports p50/p99 latency, rows/s and major faults, and fio's 4 KiB random-read IOPS at queue
    depth 64 on the same file when fio is installed; names the read path, and notes when the
    figures say nothing of serving (a table smaller than the model's, no compiled helper).

    \b
    Example:
        ple-prep bench /nvme/ple.bin
        ple-prep bench /nvme/ple.bin --json --fio-seconds 0
    """
    from .tools.benchmark import run_bench

    def say(message: str) -> None:
        # Progress, like the bars: only to a terminal.
        if not quiet and not as_json and sys.stderr.isatty():
            click.echo(f"{message} ...", err=True)

    report = run_bench(table, prefill_requests=prefill_requests, decode_requests=decode_requests,
                       fio_seconds=fio_seconds, progress=say)
    if as_json:
        echo_json(report)
        return
    cached = report["cached_after_evict"]
    if report["read_path"] == "direct":
        read_path = "direct (O_DIRECT reads, nothing left in the page cache)"
    else:
        read_path = (f"mapped (page faults behind an advice window of {report['window_pages']} pages / "
                     f"{_size(report['window_bytes'])})"
                     + (f": {report['read_path_note']}" if report["read_path_note"] else ""))
    click.echo(f"table: {table} ({_size(report['file_bytes'])}), page cache after evicting: "
               f"{'unknown' if cached is None else f'{cached:.1%}'}")
    click.echo(f"cold rows: {read_path}; warm rows: from the page cache")
    click.echo(f"{'':24}{'requests':>9}{'rows':>9}{'distinct':>9}{'p50 us':>10}{'p99 us':>10}"
               f"{'rows/s':>12}{'major faults':>14}")
    for key, label in _BENCH_ROWS:
        row = report[key]
        click.echo(f"{label:24}{row['requests']:>9,}{row['rows_per_request']:>9,.0f}"
                   f"{row['distinct_rows_per_request']:>9,.0f}{row['p50_us']:>10,.0f}"
                   f"{row['p99_us']:>10,.0f}{row['rows_per_s']:>12,}{row['major_faults']:>14,}")
    fio = report["fio"]
    if fio is None:
        click.echo("fio: not run (not installed, or --fio-seconds 0)")
    else:
        click.echo(f"fio 4 KiB random reads, queue depth {fio['queue_depth']}: {fio['iops']:,} IOPS; "
                   f"cold prefill reads {report['cold_vs_fio']:.2f}x that in distinct rows/s")
    for note in report["notes"]:
        click.echo(f"note: {note}")


if __name__ == "__main__":
    cli()
