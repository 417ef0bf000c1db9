"""Which source a yardstick process ran: a digest of the tree, checkable against the commit named.

A GPU host often gets a copy of the tree without .git, so `--commit` names the commit and the
dirty flag is unknown there. Every run therefore also records `source_sha256`: a digest of the
files that decide what the servers and the yardstick do (SOURCE: code, configs and tables, the
benchmark models' configs; not bench/results). Where git has the commit, `digest_at` recomputes
the same digest from the commit's blobs, so `verdict` tells, per process, whether it ran
exactly the named commit's source ("clean"), something else ("differs": an uncommitted change or
another commit), or cannot be told (no digest recorded, or the commit is not in this clone);
`moe-serve bench serve verify` (verify.py) reports it with the run record's other checks.
"""
from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ("pyproject.toml", "service", "kernels", "loadtest", "bench")   # paths under the repo root
EXCLUDE = ("bench/results/",)                                          # evidence, not source
SUFFIXES = (".py", ".json", ".toml", ".sh", ".yml", ".yaml", ".txt")


def _wanted(rel: str) -> bool:
    return (rel.endswith(SUFFIXES) and "__pycache__/" not in rel and not rel.startswith(EXCLUDE)
            and (rel in SOURCE or rel.split("/", 1)[0] in SOURCE))


def _digest(items: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over "path\\0sha256(content)\\n" lines, paths sorted (POSIX, relative to the root)."""
    h = hashlib.sha256()
    for rel, data in sorted(items):
        h.update(f"{rel}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return h.hexdigest()


def source_digest(root: Path = ROOT) -> str:
    """The digest of the source files as they are on disk under root."""
    files = (p for top in SOURCE if (root / top).exists()
             for p in ([root / top] if (root / top).is_file() else (root / top).rglob("*")) if p.is_file())
    return _digest((rel, (root / rel).read_bytes()) for rel in (p.relative_to(root).as_posix() for p in files)
                   if _wanted(rel))


def digest_at(commit: str, root: Path = ROOT) -> str | None:
    """The same digest over the blobs of `commit` in root's git repository; None where git or the
    commit is not available."""
    try:
        listing = subprocess.run(["git", "ls-tree", "-r", "-z", commit, "--", *SOURCE], cwd=root,
                                 capture_output=True, check=True, timeout=60).stdout.decode()
        entries = [line.split("\t", 1) for line in listing.split("\0") if line]
        blobs = [(rel, meta.split()[2]) for meta, rel in entries if meta.split()[1] == "blob" and _wanted(rel)]
        batch = subprocess.run(["git", "cat-file", "--batch"], cwd=root, check=True, timeout=120,
                               input="".join(f"{sha}\n" for _, sha in blobs).encode(), capture_output=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    items, pos = [], 0
    for rel, _ in blobs:                     # "<sha> blob <size>\n<content>\n" per object
        head_end = batch.index(b"\n", pos)
        size = int(batch[pos:head_end].split()[2])
        items.append((rel, batch[head_end + 1:head_end + 1 + size]))
        pos = head_end + 1 + size + 1
    return _digest(items)


def verdict(meta: dict, root: Path = ROOT, cache: dict[str, str | None] | None = None) -> str:
    """"clean", "differs", "no digest recorded" or "commit not in this clone" for one process's meta."""
    recorded, commit = meta.get("source_sha256"), meta.get("commit")
    if not recorded:
        return "no digest recorded"
    cache = {} if cache is None else cache
    if commit not in cache:
        cache[commit] = digest_at(commit, root) if commit else None
    if cache[commit] is None:
        return "commit not in this clone"
    return "clean" if cache[commit] == recorded else "differs"
