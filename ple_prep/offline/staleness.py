"""Has the source checkpoint changed since a table was converted from it?

The manifest records the source's fingerprint (files' names and sizes, a digest of sampled rows)
and its scale; a source that differs in any of them is not the one the table was made from.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..converters import open_source
from ..converters.base import TableSource
from ..core.errors import BadInput
from ..runtime import Table, open_table


def source_changes(manifest: dict[str, Any], source: TableSource) -> list[str]:
    """Each way `source` differs from what `manifest` recorded at conversion; empty when unchanged."""
    recorded = manifest["source"]
    current = source.fingerprint()
    changes = []
    if recorded.get("format") != current["format"]:
        changes.append(f"format was {recorded.get('format')}, now {current['format']}")
    files = recorded.get("files")
    before = {f.get("name"): f.get("size") for f in (files if isinstance(files, list) else [])
              if isinstance(f, dict)}
    after = {f["name"]: f["size"] for f in current["files"]}
    for name in sorted(before.keys() | after.keys(), key=str):
        if name not in after:
            changes.append(f"{name} is gone")
        elif name not in before:
            changes.append(f"{name} is new")
        elif before[name] != after[name]:
            changes.append(f"{name} was {before[name]} bytes, now {after[name]}")
    if source.num_rows != manifest["total_rows"]:
        changes.append(f"the table had {manifest['total_rows']} rows, now {source.num_rows}")
    scale = source.scale.to_json()["hex"] if source.scale is not None else None
    recorded_scale = manifest["scale"]["hex"] if manifest["scale"] else None
    if scale != recorded_scale:
        changes.append(f"the scale was {recorded_scale}, now {scale}")
    if not changes and recorded["sample_sha256"] != current["sample_sha256"]:
        changes.append(f"the {current['sample_rows']} sampled rows differ (same sizes, other values)")
    return changes


def converted_elsewhere(manifest: dict[str, Any], source: TableSource) -> str | None:
    """Where the table was converted from, when `source` lies elsewhere: a difference then means
    another checkpoint, not a change to this one (a copy that is unchanged passes `source_changes`)."""
    recorded = manifest["source"].get("model")
    return recorded if recorded and recorded != str(Path(source.model_dir).resolve()) else None


def check_source(manifest: dict[str, Any], source_dir: str | Path, table_name: str) -> None:
    """BadInput unless `source_dir` is still the checkpoint the table was converted from."""
    with open_source(source_dir) as source:
        changes = source_changes(manifest, source)
        origin = converted_elsewhere(manifest, source)
    if changes:
        shown = "; ".join(changes[:5]) + (f" (and {len(changes) - 5} more)" if len(changes) > 5 else "")
        if origin is not None:
            raise BadInput(f"{table_name} was converted from {origin}, not from {source_dir}: {shown}; "
                           f"give that checkpoint, or convert again")
        raise BadInput(f"{table_name} is stale: {source_dir} changed since conversion: {shown}; "
                       f"convert again")


def open_checked(path: str | Path, source_dir: str | Path, manifest: str | Path | None = None,
                 **options: Any) -> Table:
    """`open_table(path, manifest, **options)`, refusing (BadInput) a table whose source checkpoint
    `source_dir` changed since conversion."""
    table = open_table(path, manifest, **options)
    try:
        check_source(table.manifest, source_dir, table.path.name)
    except BaseException:
        table.close()
        raise
    return table
