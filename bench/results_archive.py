"""Raw result files under bench/results/: plain files, or members of a closed date's archive.

A date's runs stay plain files (bench/results/<date>/...) while runs are still being added.
Closing the date packs that directory into one archive, bench/results/<date>.tar.xz, whose
members keep their paths (<date>/...). `raw()` reads either form; archive members are read in
memory, never extracted to disk:

    python bench/results_archive.py close 2026-12-02      # pack, verify, then: git rm -r the directory
    tar -xOJf bench/results/2026-11-29.tar.xz 2026-11-29/soak/soak.json   # one file, by hand
"""
from __future__ import annotations

import argparse
import fnmatch
import io
import sys
import tarfile
from functools import lru_cache, total_ordering
from pathlib import Path, PurePosixPath
from typing import IO

RAW = Path(__file__).resolve().parent / "results"


@lru_cache(maxsize=None)
def members(archive: Path) -> dict[str, bytes]:
    """member path -> bytes, for every regular file of a .tar.xz (read once per process)."""
    with tarfile.open(archive, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


@total_ordering
class ArchivePath:
    """A file or directory inside an archive, with the part of pathlib.Path's reading interface
    the results renderers use (/, name, parent, with_suffix, exists, is_file, is_dir, read_text,
    read_bytes, open, iterdir, glob of one level)."""

    def __init__(self, archive: Path, inner: PurePosixPath | str) -> None:
        self.archive = archive
        self.inner = PurePosixPath(inner)

    def _files(self) -> dict[str, bytes]:
        return members(self.archive)

    def __truediv__(self, other: str) -> ArchivePath:
        return ArchivePath(self.archive, self.inner / other)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def suffix(self) -> str:
        return self.inner.suffix

    @property
    def parent(self) -> ArchivePath:
        return ArchivePath(self.archive, self.inner.parent)

    def with_suffix(self, suffix: str) -> ArchivePath:
        return ArchivePath(self.archive, self.inner.with_suffix(suffix))

    def is_file(self) -> bool:
        return str(self.inner) in self._files()

    def is_dir(self) -> bool:
        prefix = f"{self.inner}/"
        return any(k.startswith(prefix) for k in self._files())

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def read_bytes(self) -> bytes:
        try:
            return self._files()[str(self.inner)]
        except KeyError:
            raise FileNotFoundError(str(self)) from None

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open(self, mode: str = "r", encoding: str = "utf-8") -> IO:
        if mode not in ("r", "rb", "rt"):
            raise ValueError(f"{self}: archive members are read-only (mode {mode!r})")
        data = self.read_bytes()
        return io.BytesIO(data) if mode == "rb" else io.StringIO(data.decode(encoding))

    def iterdir(self) -> list[ArchivePath]:
        """Direct children (files and directories), sorted by name."""
        prefix = f"{self.inner}/"
        names = {k[len(prefix):].split("/", 1)[0] for k in self._files() if k.startswith(prefix)}
        return [self / n for n in sorted(names)]

    def glob(self, pattern: str) -> list[ArchivePath]:
        """Direct children whose name matches `pattern` (one level: no '/' or '**')."""
        if "/" in pattern or "**" in pattern:
            raise ValueError(f"ArchivePath.glob takes one-level patterns, not {pattern!r}")
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    def _key(self) -> tuple[str, str]:
        return str(self.archive), str(self.inner)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArchivePath) and self._key() == other._key()

    def __lt__(self, other: ArchivePath) -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        return f"{self.archive}:{self.inner}"

    def __repr__(self) -> str:
        return f"ArchivePath({str(self)!r})"


def raw(rel: str, root: Path = RAW) -> Path | ArchivePath:
    """root/<rel> (rel = '<date>/...') as a plain path if it exists, else as a member of
    root/<date>.tar.xz if that archive exists, else the (missing) plain path."""
    plain = root / rel
    archive = root / f"{PurePosixPath(rel).parts[0]}.tar.xz"
    if plain.exists() or not archive.is_file():
        return plain
    return ArchivePath(archive, rel)


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """No owner, no time, fixed modes: the same tree gives the same archive bytes."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o755 if info.isdir() else 0o644
    return info


def close(date: str, root: Path = RAW) -> Path:
    """Pack root/<date>/ into root/<date>.tar.xz (members sorted, normalized), then check that
    every file reads back byte for byte. Refuses to overwrite an archive."""
    src, out = root / date, root / f"{date}.tar.xz"
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    if out.exists():
        raise FileExistsError(f"{out} exists: a closed date is not re-packed")
    files = sorted(p for p in src.rglob("*") if p.is_file())
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for p in files:
            tar.add(p, arcname=p.relative_to(root).as_posix(), recursive=False, filter=_normalized)
    members.cache_clear()
    packed = members(out)
    bad = [str(p) for p in files if packed.get(p.relative_to(root).as_posix()) != p.read_bytes()]
    if bad or len(packed) != len(files):
        out.unlink()
        raise RuntimeError(f"archive check failed ({len(packed)} members, {len(files)} files): {bad[:5]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("close", help="pack bench/results/<date>/ into bench/results/<date>.tar.xz")
    c.add_argument("date")
    a = p.parse_args(argv)
    out = close(a.date)
    n = len(members(out))
    print(f"{out}: {n} files, {out.stat().st_size:,} B; now: git rm -r -q {RAW / a.date} && git add {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
