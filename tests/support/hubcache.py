"""Build a Hugging Face cache folder in the hub's real layout, for tests of name resolution.

HUB/models--OWNER--NAME/blobs/<sha256 of the bytes>, snapshots/<commit>/<file> a relative symlink
to its blob, refs/<branch> a file holding the commit hash (no newline), as huggingface_hub writes it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_hash(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes],
                 refs: tuple[str, ...] = ("main",), repo_type: str = "model") -> Path:
    """Add one snapshot of `repo_id` holding `files`, pointed at by `refs`; returns the snapshot folder."""
    repo = cache / "--".join([f"{repo_type}s", *repo_id.split("/")])
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        ref_file = repo / "refs" / ref
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        ref_file.write_text(commit)
    return snapshot


def add_checkpoint(cache: Path, repo_id: str, checkpoint: Path, commit: str) -> Path:
    """Cache a checkpoint folder written by `make_checkpoint` as a snapshot of `repo_id` on main."""
    files = {str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*"))
             if p.is_file()}
    return add_snapshot(cache, repo_id, commit, files)
