"""Stable digests: of files (their content, computed once per file version and kept on disk), and of
byte strings as ints. Unlike Python's hash(), which is salted per process, these agree between
processes and across restarts: the data-parallel router and its replicas, and a KV store on disk."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

_CACHE_FILE = Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm")) / "file-digests.json"
_lock = threading.Lock()
_known: dict[str, str] | None = None


def int_digest(*parts: bytes) -> int:
    """A 128-bit int of blake2b over the parts (each length-prefixed, so that no two sequences of
    parts run together alike)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "little")


def file_digest(path: str | os.PathLike) -> str:
    """The sha256 of a file's content, read once per (path, size, modification time) and kept in
    the user's cache directory, so that a start-up does not hash gigabytes of weights again."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{real}|{stat.st_size}|{stat.st_mtime_ns}"
    with _lock:
        known = _load()
        if key in known:
            return known[key]
    sha = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    with _lock:
        known = _load()
        known[key] = sha.hexdigest()
        _save(known)
    return known[key]


def _load() -> dict[str, str]:
    global _known
    if _known is None:
        try:
            _known = json.loads(_CACHE_FILE.read_text())
        except (OSError, ValueError):
            _known = {}
    return _known


def _save(known: dict[str, str]) -> None:
    """Written whole to a temporary file, then renamed over: a reader never sees half of it."""
    try:
        _CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _CACHE_FILE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, _CACHE_FILE)
    except OSError:
        pass  # a read-only home: digests are computed again next time
