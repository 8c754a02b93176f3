"""Find a model the way people name it: a folder, or a Hugging Face name looked up in the local cache.

Offline only: this reads the cache that `huggingface_hub` keeps (HUB/models--OWNER--NAME/ with
refs/BRANCH holding a commit hash and snapshots/HASH/ holding the files) and never downloads:
repos are found by folder name, and a revision becomes a snapshot folder through
`huggingface_hub.snapshot_download(..., local_files_only=True)`, which also refuses a snapshot the
hub knows an interrupted download left incomplete.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..core.constants import GGUF_SPLIT_NAME
from ..core.errors import BadInput
from ..core.fileio import read_bounded

# OWNER/NAME or NAME as the hub spells them, then optionally @REVISION (a branch, tag or commit
# hash) and :QUANT (a GGUF file of the repo, as llama.cpp's `-hf OWNER/NAME:QUANT` picks one).
_NAME = re.compile(r"^(?:(?P<owner>[\w.-]+)/)?(?P<name>[\w.-]+)"
                   r"(?:@(?P<revision>[\w./-]+))?(?::(?P<quant>[\w.-]+))?$")
_LISTED = 8
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def hub_cache_dir() -> Path:
    """The cache folder `huggingface_hub` uses, read from the environment now.

    Same order as `huggingface_hub.constants`: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub,
    XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub. Read at call time, not import time,
    so a caller (or a test) that sets the variables later is still obeyed.
    """
    def expand(value: str) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(value)))

    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return expand(os.environ[variable])
    if os.environ.get("HF_HOME"):
        return expand(os.environ["HF_HOME"]) / "hub"
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return expand(cache_home) / "huggingface" / "hub"


def resolve_model(name_or_path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint folder (or file) for a path or a model name.

    An existing path wins. Otherwise `OWNER/NAME` is that cached repo; a bare `NAME` is the one
    cached repo whose name is NAME (any owner), or failing that the one named `NAME-<variant>`
    (so `Qwen3.8-Flash-Next` finds a lone cached `Qwen/Qwen3.8-Flash-Next-FP8`). `@REVISION` picks
    a branch, tag or commit; the default is `main`, or the only snapshot when refs/main is absent.
    `:QUANT` picks the GGUF file (or the first file of a split set) whose path in the snapshot
    names that quantisation, e.g. `unsloth/Qwen3.8-Flash-Next-GGUF:IQ4_NL`.
    Raises BadInput when nothing or more than one repo or file matches, naming the cache it read.
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return path
    match = _NAME.match(text)
    if match is None or text.startswith("."):
        raise BadInput(f"{text} does not exist")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    repos = _cached_models(cache)
    owner, name, revision, quant = match["owner"], match["name"], match["revision"], match["quant"]
    if owner is not None:
        wanted = f"{owner}/{name}".lower()
        found = [repo for repo in repos if repo.lower() == wanted]
    else:
        found = [repo for repo in repos if _name_part(repo) == name.lower()]
        if not found:
            found = [repo for repo in repos if _name_part(repo).startswith(name.lower() + "-")]
    if quant is not None and len(found) > 1:
        # `NAME:QUANT` means a GGUF repo: a safetensors repo of the same name is no rival.
        found = [repo for repo in found if any(repos[repo].glob("snapshots/*/**/*.gguf"))] or found
    if not found:
        raise BadInput(_nothing_found(text, path, cache, sorted(repos)))
    if len(found) > 1:
        raise BadInput(f"{name} matches {len(found)} models in the Hugging Face cache at {cache}: "
                       f"{', '.join(sorted(found))}; name one in full")
    snapshot = _snapshot(found[0], repos[found[0]], cache, revision)
    return snapshot if quant is None else _gguf_file(found[0], snapshot, quant)


def _cached_models(cache: Path) -> dict[str, Path]:
    """Repo id to folder of each model repo in the cache, from the folder names alone.

    The hub names a repo's folder `models--OWNER--NAME`; listing names is one directory read,
    where `scan_cache_dir` would stat every file of every repo (about a second for 20,000 files).
    A folder whose name is no repo id the hub accepts (`models--a--b--c`, `..` in a name) is no
    download of the hub's, and is skipped.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not cache.is_dir():
        return {}
    repos = {}
    for entry in cache.iterdir():
        if entry.name.startswith("models--") and entry.is_dir():
            repo_id = entry.name[len("models--"):].replace("--", "/")
            try:
                validate_repo_id(repo_id)
            except HFValidationError:
                continue
            repos[repo_id] = entry
    return repos


def _name_part(repo_id: str) -> str:
    return repo_id.rsplit("/", 1)[-1].lower()


def _nothing_found(text: str, path: Path, cache: Path, cached: list[str]) -> str:
    where = f"the Hugging Face cache at {cache}" if cache.is_dir() else \
        f"the Hugging Face cache at {cache} (no such folder)"
    listing = (f"; cached: {', '.join(cached[:_LISTED])}" + (", ..." if len(cached) > _LISTED else "")
               if cached else "")
    return (f"no model {text} in {where}{listing}; no folder {path} either "
            "(set HF_HUB_CACHE or HF_HOME, or give a path)")


def _snapshot(repo_id: str, folder: Path, cache: Path, revision: str | None) -> Path:
    """The snapshot folder of `revision` (default main), resolved by `snapshot_download` offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    refs = sorted(p.relative_to(folder / "refs").as_posix()
                  for p in (folder / "refs").glob("**/*") if p.is_file())
    commits = sorted(p.name for p in (folder / "snapshots").glob("*") if p.is_dir())
    if revision is None:
        if "main" in refs:
            revision = "main"
        elif len(commits) == 1:
            revision = commits[0]
        else:
            listed = ", ".join(c[:12] for c in commits) or "none"
            raise BadInput(f"{repo_id} has no refs/main and {len(commits)} snapshots ({listed}) in "
                           f"{folder}: pick one with {repo_id}@REVISION")
    elif revision not in refs and revision not in commits:
        # A commit hash may be shortened, as git allows, to 7 or more characters.
        prefixed = [c for c in commits if c.startswith(revision)] if len(revision) >= 7 else []
        if len(prefixed) != 1:
            known = ", ".join(refs + [c[:12] for c in commits]) or "none"
            raise BadInput(f"{repo_id} has no cached revision {revision} in {folder} (cached: {known})")
        revision = prefixed[0]
    commit = _read_ref(folder, revision, repo_id) if revision in refs else revision
    try:
        snapshot = Path(snapshot_download(repo_id, revision=commit, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError as error:
        # A ref naming a missing snapshot, or an interrupted download the hub knows is incomplete.
        raise BadInput(f"{repo_id}@{revision} in {folder}: {error}".replace("\n", " ")) from None
    # Snapshots are folders of the cache; one that leads elsewhere (a planted link) is not followed.
    if not snapshot.resolve().is_relative_to((folder / "snapshots").resolve()):
        raise BadInput(f"{repo_id}@{revision}: the snapshot {snapshot} leads outside the cache at {cache}")
    return snapshot


def _read_ref(folder: Path, ref: str, repo_id: str) -> str:
    """The commit hash a ref file holds; anything but a hash (a path out of the cache) is refused."""
    if ".." in Path(ref).parts or Path(ref).is_absolute():
        raise BadInput(f"{repo_id}: revision {ref!r} is not a branch or tag name")
    commit = read_bounded(folder / "refs" / ref, 4096, "cache ref").decode(errors="replace").strip()
    if not _COMMIT.fullmatch(commit):
        raise BadInput(f"{repo_id}: refs/{ref} in {folder} does not hold a commit hash; the cache is "
                       f"damaged (delete that ref or download the model again)")
    return commit


def _gguf_file(repo_id: str, snapshot: Path, quant: str) -> Path:
    """The one GGUF model in `snapshot` named by `quant`: its file, or the first of its split set."""
    files = sorted(snapshot.rglob("*.gguf"))
    named = re.compile(rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9])")
    models: dict[str, Path] = {}
    for file in files:
        if not named.search(file.relative_to(snapshot).as_posix().lower()):
            continue
        split = GGUF_SPLIT_NAME.match(file.name)
        key = str(file.parent / split["stem"]) if split else str(file)
        if key not in models or (split is not None and int(split["index"]) == 1):
            models[key] = file
    if not models:
        available = ", ".join(f.relative_to(snapshot).as_posix() for f in files[:_LISTED]) or "none"
        raise BadInput(f"no GGUF file of {repo_id} in {snapshot} is named {quant} "
                       f"(.gguf files: {available})")
    if len(models) > 1:
        listed = ", ".join(sorted(p.relative_to(snapshot).as_posix() for p in models.values()))
        raise BadInput(f"{quant} names {len(models)} GGUF models of {repo_id}: {listed}; "
                       "give a longer QUANT")
    return next(iter(models.values()))
