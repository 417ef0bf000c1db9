"""bench/results_archive.py: closing a date into one .tar.xz and reading its members in place, so
the results renderers give the same blocks from the archive as from the plain files."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import results_archive as ra  # noqa: E402


def _date_tree(root: Path, date: str = "2031-01-02") -> Path:
    """A date's raw files as a run leaves them: JSON run files with logs, a gzipped file, a csv."""
    d = root / date
    (d / "dab").mkdir(parents=True)
    for r, (v, tok_s) in enumerate((("stock", 100.0), ("moe-serve", 110.0), ("stock", 101.0), ("moe-serve", 111.0))):
        run = {"variant": v, "round": r // 2, "prompts": "distinct", "temperature": 1.0, "model": "/m/x",
               "rows": [{"B": 1, "tok_s": tok_s, "step_ms": 1e3 / tok_s}]}
        (d / "dab" / f"run-r{r // 2}-{v}.json").write_text(json.dumps(run))
        (d / "dab" / f"run-r{r // 2}-{v}.log").write_text(f"log of {v}\n")
    (d / "e2e" / "vllm").mkdir(parents=True)
    (d / "e2e" / "vllm" / "requests.jsonl.gz").write_bytes(gzip.compress(b'{"ttft": 0.1}\n'))
    (d / "rss.csv").write_text("t,rss\n0,1.5\n")
    return d


def test_a_closed_date_reads_like_its_plain_files(tmp_path: Path) -> None:
    plain = _date_tree(tmp_path)
    before = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in plain.rglob("*") if p.is_file()}
    a_dir = ra.raw("2031-01-02/dab", root=tmp_path)
    assert isinstance(a_dir, Path)                                  # plain files while the date is open
    out = ra.close("2031-01-02", root=tmp_path)
    assert out == tmp_path / "2031-01-02.tar.xz"
    assert ra.members(out) == before
    shutil.rmtree(plain)                                          # the directory goes (git rm -r)

    d = ra.raw("2031-01-02/dab", root=tmp_path)
    assert isinstance(d, ra.ArchivePath) and d.is_dir() and d.exists() and not d.is_file()
    runs = sorted(d.glob("run-r*-*.json"))
    assert [p.name for p in runs] == ["run-r0-moe-serve.json", "run-r0-stock.json",
                                      "run-r1-moe-serve.json", "run-r1-stock.json"]
    assert runs[1].with_suffix(".log").read_text() == "log of stock\n"
    assert runs[1].parent.name == "dab" and runs[1] == d / "run-r0-stock.json"
    assert [p.name for p in ra.raw("2031-01-02", root=tmp_path).iterdir()] == ["dab", "e2e", "rss.csv"]
    req = ra.raw("2031-01-02/e2e", root=tmp_path) / "vllm" / "requests.jsonl"
    assert not req.exists() and gzip.decompress(req.with_suffix(".jsonl.gz").read_bytes()) == b'{"ttft": 0.1}\n'
    assert ra.raw("2031-01-02/rss.csv", root=tmp_path).open().read() == "t,rss\n0,1.5\n"
    with pytest.raises(FileNotFoundError):
        (d / "missing.json").read_text()
    with pytest.raises(ValueError, match="read-only"):
        runs[0].open("w")
    with pytest.raises(ValueError, match="one-level"):
        d.glob("**/*.json")
    assert not ra.raw("2031-01-03/x.json", root=tmp_path).exists()   # no such date at all


def test_decode_stats_read_the_same_runs_from_the_archive(tmp_path: Path) -> None:
    import decode_stats

    plain = _date_tree(tmp_path)
    from_plain = decode_stats.summarize(decode_stats.load_runs([plain / "dab"]), "stock")
    ra.close("2031-01-02", root=tmp_path)
    shutil.rmtree(plain)
    from_archive = decode_stats.summarize(decode_stats.load_runs([ra.raw("2031-01-02/dab", root=tmp_path)]), "stock")
    assert from_archive == from_plain and from_plain[0]["n"] == 2


def test_closing_is_reproducible_and_never_overwrites(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _date_tree(a)
    _date_tree(b)
    for p in (b / "2031-01-02").rglob("*"):                    # other times, same content
        os.utime(p, (1e9, 1e9))
    assert ra.close("2031-01-02", root=a).read_bytes() == ra.close("2031-01-02", root=b).read_bytes()
    with pytest.raises(FileExistsError):
        ra.close("2031-01-02", root=a)
    with pytest.raises(FileNotFoundError):
        ra.close("2031-01-05", root=a)


def test_the_committed_archives_hold_the_raw_files_the_registry_names() -> None:
    import results_tables

    archived = [p for e in results_tables.REGISTRY.values() for p in results_tables._flat(e.raw)
                if isinstance(ra.raw(p), ra.ArchivePath)]
    assert archived and all(ra.raw(p).exists() for p in archived)
    closed = [p.name.removesuffix(".tar.xz") for p in ra.RAW.glob("*.tar.xz")]
    assert closed and not [d for d in closed if (ra.RAW / d).exists()]   # no plain copy shadows an archive
