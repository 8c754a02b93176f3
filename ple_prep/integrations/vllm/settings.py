"""Where the operator points vLLM at a prepared table: vLLM's additional config or the environment.

    --additional-config '{"ple_prep": {"table": "/nvme/ple.bin", "resident_bytes": "4GiB", "read_path": "mapped"}}'
    PLE_PREP_TABLE=/nvme/ple.bin  PLE_PREP_RESIDENT_BYTES=4GiB  PLE_PREP_READ_PATH=mapped

The additional config wins over the environment, key by key. With tensor parallelism the table
path names each rank's file through `{rank}` and `{size}` (`/nvme/ple.tp{rank}of{size}.bin`, the
names `ple-prep convert --tp-size` writes). Standard library only: nothing here needs vLLM or torch.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ...core.errors import BadInput

CONFIG_KEY = "ple_prep"
TABLE_VARIABLE = "PLE_PREP_TABLE"
RESIDENT_VARIABLE = "PLE_PREP_RESIDENT_BYTES"
READ_PATH_VARIABLE = "PLE_PREP_READ_PATH"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


@dataclasses.dataclass(frozen=True)
class Settings:
    table: str                  # the path, possibly with {rank} and {size}
    resident_bytes: int | None  # None: from the table's residency hints
    read_path: str | None = None  # the disk tier's read path (open_table's read_path); None: its default

    def table_path(self, rank: int, size: int) -> str:
        try:
            return self.table.format(rank=rank, size=size)
        except (KeyError, IndexError, ValueError):
            raise BadInput(f"table path {self.table!r}: only {{rank}} and {{size}} may stand in braces") from None


def parse_bytes(text: str | int, what: str) -> int:
    """A byte count: an integer, or a number with a unit (4GiB, 512M, 1.5G; binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        count = text
    else:
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = found and found.group(2).lower()
        if not found or unit not in _UNITS:
            raise BadInput(f"{what} must be a byte count such as 4GiB or 4294967296, not {text!r}")
        count = int(float(found.group(1)) * _UNITS[unit])
    if count < 0:
        raise BadInput(f"{what} must not be negative")
    return count


def read_settings(additional_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> Settings | None:
    """The operator's settings, or None when the table is not configured (vLLM then runs unchanged)."""
    section = (additional_config or {}).get(CONFIG_KEY) or {}
    if not isinstance(section, Mapping):
        raise BadInput(f"additional_config[{CONFIG_KEY!r}] must be an object with 'table'")
    unknown = set(section) - {"table", "resident_bytes", "read_path"}
    if unknown:
        raise BadInput(f"additional_config[{CONFIG_KEY!r}] has unknown keys: {', '.join(sorted(unknown))}")
    table = section.get("table") or environ.get(TABLE_VARIABLE)
    if not table:
        return None
    resident = section.get("resident_bytes", environ.get(RESIDENT_VARIABLE))
    where = f"additional_config[{CONFIG_KEY!r}]['resident_bytes']" if "resident_bytes" in section \
        else RESIDENT_VARIABLE
    read_path = section.get("read_path", environ.get(READ_PATH_VARIABLE)) or None
    return Settings(str(table), None if resident in (None, "") else parse_bytes(resident, where),
                    None if read_path is None else str(read_path))
