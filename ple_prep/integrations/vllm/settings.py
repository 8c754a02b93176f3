"""Where the operator points vLLM at a prepared table: vLLM's additional config or the environment.

    --additional-config '{"ple_prep": {"table": "/nvme/ple.bin", "resident_bytes": "4GiB", "read_path": "mapped"}}'
    PLE_PREP_TABLE=/nvme/ple.bin  PLE_PREP_RESIDENT_BYTES=4GiB  PLE_PREP_READ_PATH=mapped  PLE_PREP_READ_TIMEOUT=30
    PLE_PREP_HOST_CACHE_BYTES=2GiB  PLE_PREP_READ_AHEAD=off  PLE_PREP_RECORD_PROFILE=/var/ple/served.prof

The additional config wins over the environment, key by key. With tensor parallelism the table
path names each rank's file through `{rank}` and `{size}` (`/nvme/ple.tp{rank}of{size}.bin`, the
names `ple-prep convert --tp-size` writes). Everything is checked here, when vLLM starts, and a
refusal names the setting it comes from (`PLE_PREP_TABLE=/nvme/x.bin: no such file`). No vLLM or
torch: this runs in vLLM's every process before a model is built.

A new setting is one `Settings` field and one `Key` in `KEYS` (its parser takes the raw value and
the name of where it was set, and raises `BadInput` through `refuse`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from ...core.errors import BadInput
from ...runtime import READ_PATHS
from .environment import TABLE_VARIABLE

CONFIG_KEY = "ple_prep"
RESIDENT_VARIABLE = "PLE_PREP_RESIDENT_BYTES"
READ_PATH_VARIABLE = "PLE_PREP_READ_PATH"
READ_TIMEOUT_VARIABLE = "PLE_PREP_READ_TIMEOUT"
VERIFY_READS_VARIABLE = "PLE_PREP_VERIFY_READS"
# The longest read timeout a setting may ask for: an hour, past any disk's own retry time.
MAX_READ_TIMEOUT_SECONDS = 3600
# Seconds as people write them: "30", "2.5s", "60 s".
_SECONDS = re.compile(r"([0-9]{1,6})(?:\.([0-9]{1,6}))? ?s?", re.ASCII)
STATS_VARIABLE = "PLE_PREP_STATS_SECONDS"
# The lookup's counters go to vLLM's log this often by default; at most once a day.
DEFAULT_STATS_SECONDS = 60.0
MAX_STATS_SECONDS = 86400.0
HOST_CACHE_VARIABLE = "PLE_PREP_HOST_CACHE_BYTES"
READ_AHEAD_VARIABLE = "PLE_PREP_READ_AHEAD"
RECORD_PROFILE_VARIABLE = "PLE_PREP_RECORD_PROFILE"
# Byte units, by their lowercase spelling: GB, MB, KB, TB are powers of 1000 (4GB = 4 * 10**9), GiB,
# MiB, KiB, TiB, Kubernetes' Gi, Mi, Ki, Ti and the bare letters G, M, K, T powers of 1024
# (4GiB = 4Gi = 4G = 4 * 2**30).
UNITS = {"": 1, "b": 1,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20,
         "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40}
# The most a byte count may say where nothing tighter applies: 1 TiB, above any one GPU's memory and
# 20 times the whole FP8 table, so that a typo of a few digits is refused rather than believed.
MAX_BYTES = 1 << 40
# A number with an optional fraction and unit, ASCII only ("4GiB", "1.5 G", "4294967296").
_BYTE_COUNT = re.compile(r"([0-9]{1,15})(?:\.([0-9]{1,9}))? ?([A-Za-z]{0,3})", re.ASCII)
_TEMPLATE_FIELDS = ("rank", "size")


def refuse(where: str, value: Any, cause: str) -> BadInput:
    """The error for a setting: the place it was set, the value as written there, and why."""
    shown = value if where.isidentifier() and isinstance(value, str) else json.dumps(value, default=repr)
    return BadInput(f"{where}={shown}: {cause}")


def parse_bytes(value: Any, where: str, limit: int = MAX_BYTES) -> int:
    """A byte count: an integer (a JSON number such as 4e9 too, if whole), or ASCII digits with an
    optional fraction and unit (`UNITS`: 4GB = 4 * 10**9, 4GiB = 4G = 4 * 2**30), at most `limit`; a
    fraction of a byte rounds down."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str):
        found = _BYTE_COUNT.fullmatch(value.strip())
        unit = found.group(3).lower() if found else None
        if unit not in UNITS:
            raise refuse(where, value, "not a byte count; write one such as 4GiB (4 * 2**30), 4GB (4 * 10**9) "
                                       "or 4294967296")
        whole, fraction = found.group(1), found.group(2) or ""
        count = (int(whole) * UNITS[unit]) + (int(fraction or "0") * UNITS[unit]) // 10**len(fraction)
    else:
        raise refuse(where, value, "not a byte count; write one such as 4GiB or 4294967296")
    if count < 0:
        raise refuse(where, value, "a byte count must not be negative")
    if count > limit:
        raise refuse(where, value, f"more than the {limit} bytes ({limit / 2**30:g} GiB) a byte count may say here")
    return count


def host_memory_bytes() -> int:
    """This host's physical memory: the bound of a byte count of host memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_table(value: Any, where: str) -> str:
    """A table path whose braces hold only `{rank}` and `{size}`: no format spec, conversion,
    attribute or index (those could build huge strings or reach into objects)."""
    if not isinstance(value, str) or not value:
        raise refuse(where, value, "the table must be a path")
    try:
        fields = list(string.Formatter().parse(value))
    except ValueError as exc:
        raise refuse(where, value, f"{exc}; write a literal brace as {{{{ or }}}}") from None
    for _literal, name, spec, conversion in fields:
        if name is not None and (name not in _TEMPLATE_FIELDS or spec or conversion):
            text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise refuse(where, value, f"only {{rank}} and {{size}} may stand in braces, without a format "
                                       f"spec, conversion, attribute or index; not {text}")
    return value


def parse_read_path(value: Any, where: str) -> str:
    """One of READ_PATHS, in any case, blanks around it ignored."""
    path = value.strip().lower() if isinstance(value, str) else None
    if path not in READ_PATHS:
        raise refuse(where, value, f"the read path is one of {', '.join(READ_PATHS)}")
    return path


def _seconds(value: Any) -> float | None:
    """A number of seconds as written ("30", "2.5s", "60 s", 30), or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and (found := _SECONDS.fullmatch(value.strip())):
        return float(f"{found.group(1)}.{found.group(2) or 0}")
    return None


def parse_seconds(value: Any, where: str) -> float:
    """A positive number of seconds, at most MAX_READ_TIMEOUT_SECONDS ("30", "2.5s", 30)."""
    seconds = _seconds(value)
    if seconds is None:
        raise refuse(where, value, "not a number of seconds; write one such as 30 or 2.5s")
    if not 0 < seconds <= MAX_READ_TIMEOUT_SECONDS:
        raise refuse(where, value, f"the read timeout is more than 0 and at most {MAX_READ_TIMEOUT_SECONDS} seconds")
    return seconds


def parse_switch(value: Any, where: str) -> bool:
    """On or off: true/false, 1/0, yes/no, on/off (any case), or a JSON boolean."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise refuse(where, value, "on or off: write 1 or 0 (true/false, yes/no, on/off)")


def parse_host_bytes(value: Any, where: str) -> int:
    """A byte count of host memory: at most the host's memory."""
    return parse_bytes(value, where, host_memory_bytes())


def parse_profile_path(value: Any, where: str) -> str:
    """Where to write the recorded profile: a file in an existing folder."""
    if not isinstance(value, str) or not value:
        raise refuse(where, value, "the profile must be a path")
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise refuse(where, value, f"no such folder: {folder}")
    if os.path.isdir(value):
        raise refuse(where, value, "a directory, not a profile file")
    return value


def parse_stats_seconds(value: Any, where: str) -> float:
    """Seconds between the log's stats lines: 0 (none) to MAX_STATS_SECONDS ("60", "60s", 60)."""
    seconds = _seconds(value)
    if seconds is None or not 0 <= seconds <= MAX_STATS_SECONDS:
        raise refuse(where, value, f"seconds between stats lines, 0 (none) to {MAX_STATS_SECONDS:g}")
    return seconds


@dataclasses.dataclass(frozen=True)
class Key:
    """One setting: its field of `Settings` (also its key in the additional config), its
    environment variable, and its parser (raw value, where it was set) -> value."""
    field: str
    variable: str
    parse: Callable[[Any, str], Any]


KEYS = (
    Key("table", TABLE_VARIABLE, parse_table),
    Key("resident_bytes", RESIDENT_VARIABLE, parse_bytes),
    Key("read_path", READ_PATH_VARIABLE, parse_read_path),
    Key("read_timeout", READ_TIMEOUT_VARIABLE, parse_seconds),
    Key("verify_reads", VERIFY_READS_VARIABLE, parse_switch),
    Key("stats_seconds", STATS_VARIABLE, parse_stats_seconds),
    Key("host_cache_bytes", HOST_CACHE_VARIABLE, parse_host_bytes),
    Key("read_ahead", READ_AHEAD_VARIABLE, parse_switch),
    Key("record_profile", RECORD_PROFILE_VARIABLE, parse_profile_path),
)
# The settings passed on to open_table as they are, by name.
OPEN_OPTIONS = ("read_path", "read_timeout", "verify_reads", "host_cache_bytes")


@dataclasses.dataclass(frozen=True)
class Settings:
    table: str                  # the path, possibly with {rank} and {size}
    resident_bytes: int | None = None  # None: from the table's residency hints
    read_path: str | None = None  # the disk tier's read path (open_table's read_path); None: its default
    read_timeout: float | None = None  # open_table's read_timeout; None: its default
    verify_reads: bool | None = None  # open_table's verify_reads; None: its default (off)
    stats_seconds: float = DEFAULT_STATS_SECONDS  # between the lookup's lines in vLLM's log; 0: none
    host_cache_bytes: int | None = None  # the host cache's budget (open_table's); None: its default
    read_ahead: bool = True  # read new requests' later prompt chunks ahead (traffic.py)
    record_profile: str | None = None  # where to write a sampled profile of served requests (traffic.py)
    # Where each set field came from (`PLE_PREP_TABLE` or `additional_config['ple_prep']['table']`).
    origins: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def open_options(self) -> dict[str, Any]:
        """open_table's keyword arguments that were set (OPEN_OPTIONS)."""
        return {name: getattr(self, name) for name in OPEN_OPTIONS if getattr(self, name) is not None}

    def table_path(self, rank: int, size: int) -> str:
        """This rank's table file, which must exist."""
        where, path, named = self._rank_table(rank, size)
        if not os.path.exists(path):
            raise refuse(where, named, "no such file")
        if os.path.isdir(path):
            raise refuse(where, named, "a directory, not a table file")
        return path

    def refused_table(self, rank: int, size: int, error: Exception) -> BadInput:
        """The error of a table that `open_table` refused, naming the settings it was opened with."""
        where, _path, named = self._rank_table(rank, size)
        options = [self.origins[name] for name in OPEN_OPTIONS if getattr(self, name) is not None]
        opened = f" (opened with {', '.join(options)})" if options else ""
        return refuse(where, named, f"{error}{opened}")

    def _rank_table(self, rank: int, size: int) -> tuple[str, str, str]:
        """Where the table was set, this rank's file, and the value as a message shows it."""
        where = self.origins.get("table", TABLE_VARIABLE)
        path = parse_table(self.table, where).format(rank=rank, size=size)
        return where, path, self.table if path == self.table else f"{self.table} (rank {rank} of {size}: {path})"


def read_settings(additional_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> Settings | None:
    """The operator's settings, or None when the table is not configured (vLLM then runs unchanged)."""
    section = (additional_config or {}).get(CONFIG_KEY) or {}
    if not isinstance(section, Mapping):
        raise BadInput(f"additional_config[{CONFIG_KEY!r}] must be an object with 'table'")
    unknown = set(section) - {key.field for key in KEYS}
    if unknown:
        raise BadInput(f"additional_config[{CONFIG_KEY!r}] has unknown keys: {', '.join(sorted(map(str, unknown)))}"
                       f" (known: {', '.join(key.field for key in KEYS)})")
    raw_values: dict[str, tuple[str, Any]] = {}
    for key in KEYS:
        if key.field in section and not _unset(section[key.field]):
            raw_values[key.field] = f"additional_config[{CONFIG_KEY!r}][{key.field!r}]", section[key.field]
        elif not _unset(environ.get(key.variable)):
            raw_values[key.field] = key.variable, environ[key.variable]
    if "table" not in raw_values:
        configured = sorted(field for field in raw_values if field in section)
        if configured:
            raise BadInput(f"additional_config[{CONFIG_KEY!r}] sets {', '.join(configured)} but no table: set "
                           f"its 'table' or {TABLE_VARIABLE}")
        return None  # other PLE_PREP_ variables alone leave the plugin off, as without them
    values = {field: key.parse(raw_values[field][1], raw_values[field][0])
              for key in KEYS if (field := key.field) in raw_values}
    return Settings(**values, origins={field: where for field, (where, _raw) in raw_values.items()})


def _unset(value: Any) -> bool:
    """Whether a setting's raw value leaves it unset: none, or only white space."""
    return value is None or (isinstance(value, str) and not value.strip())
