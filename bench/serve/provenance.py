"""Which source a yardstick process ran: a digest of the tree, checkable against the commit named.

A GPU host often gets a copy of the tree without .git, so `--commit` names the commit and the
dirty flag is unknown there. Every run therefore also records `source_sha256`: a digest of the
files that decide what the servers and the yardstick do (SOURCE: code, configs and tables, the
benchmark models' configs; not bench/results). Where git has the commit, `digest_at` recomputes
the same digest from the commit's blobs, so `verdict` tells, per process, whether it ran
exactly the named commit's source ("clean"), something else ("differs": an uncommitted change or
another commit), or cannot be told (no digest recorded, or the commit is not in this clone);
`moe-serve bench serve verify` (verify.py) reports it with the run record's other checks.

A process started from a checkout digests the checkout's SOURCE; one started from an installed
package (`pip install .`: the folders under moe_serve/) digests what the package installs, which
is SOURCE less the files pip leaves out (pyproject.toml, setup scripts, example reports). `verdict`
accepts either selection of the commit's blobs, the installed one read from that commit's own
pyproject.toml (its package-dir and package-data).
"""
from __future__ import annotations

import fnmatch
import hashlib
import subprocess
import tomllib
from collections.abc import Callable, Iterable
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


def source_digest(root: Path = ROOT, installed: bool = False) -> str:
    """The digest of the source files as they are on disk under root (installed: only those
    `pip install .` of root's pyproject.toml installs)."""
    keep = installed_selection((root / "pyproject.toml").read_text()) if installed else _wanted
    files = (p for top in SOURCE if (root / top).exists()
             for p in ([root / top] if (root / top).is_file() else (root / top).rglob("*")) if p.is_file())
    return _digest((rel, (root / rel).read_bytes()) for rel in (p.relative_to(root).as_posix() for p in files)
                   if _wanted(rel) and keep(rel))


def installed_selection(pyproject: str) -> Callable[[str], bool]:
    """Which repo-relative paths `pip install .` puts in the package, from pyproject.toml's text:
    the .py files under each package-dir folder and the package-data globs (a glob's `*` stays
    within one folder, as setuptools reads it)."""
    tool = tomllib.loads(pyproject)["tool"]["setuptools"]
    folders = dict(tool["package-dir"])                        # moe_serve.kernels -> kernels
    globs = []
    for package, patterns in tool.get("package-data", {}).items():
        base = next(f"{folder}{package.removeprefix(name).replace('.', '/')}"
                    for name, folder in folders.items() if package == name or package.startswith(name + "."))
        globs += [f"{base}/{pattern}" for pattern in patterns]

    def installed(rel: str) -> bool:
        if rel.endswith(".py") and rel.split("/", 1)[0] in folders.values():
            return True
        return any(rel.count("/") == g.count("/") and fnmatch.fnmatchcase(rel, g) for g in globs)
    return installed


def _blobs(commit: str, root: Path) -> list[tuple[str, bytes]] | None:
    """(path, content) of the commit's SOURCE files; None where git or the commit is not available."""
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
    return items


def _installed_items(items: list[tuple[str, bytes]]) -> list[tuple[str, bytes]] | None:
    """The items `pip install .` of their own pyproject.toml installs; None without one."""
    pyproject = dict(items).get("pyproject.toml")
    if pyproject is None:
        return None
    keep = installed_selection(pyproject.decode())
    return [(rel, data) for rel, data in items if keep(rel)]


def digest_at(commit: str, root: Path = ROOT, installed: bool = False) -> str | None:
    """The same digest over the blobs of `commit` in root's git repository (installed: only those
    `pip install .` of that commit installs); None where git or the commit is not available."""
    items = _blobs(commit, root)
    if items is not None and installed:
        items = _installed_items(items)
    return None if items is None else _digest(items)


def _digests_at(commit: str, root: Path) -> tuple[str | None, ...]:
    """(checkout digest, installed digest) of `commit`, its blobs read once; (None,) where git or
    the commit is not available."""
    items = _blobs(commit, root)
    if items is None:
        return (None,)
    installed = _installed_items(items)
    return (_digest(items),) + (() if installed is None else (_digest(installed),))


def verdict(meta: dict, root: Path = ROOT, cache: dict[str, tuple[str | None, ...]] | None = None) -> str:
    """"clean", "differs", "no digest recorded" or "commit not in this clone" for one process's meta
    (clean: the recorded digest is the commit's checkout or its installed package)."""
    recorded, commit = meta.get("source_sha256"), meta.get("commit")
    if not recorded:
        return "no digest recorded"
    cache = {} if cache is None else cache
    if commit not in cache:
        cache[commit] = _digests_at(commit, root) if commit else (None,)
    if cache[commit][0] is None:
        return "commit not in this clone"
    return "clean" if recorded in cache[commit] else "differs"
