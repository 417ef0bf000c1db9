"""bench/RESULTS.md's generated tables match the committed raw files (bench/results_tables.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "results_tables.py"
sys.path.insert(0, str(SCRIPT.parent))
import results_tables  # noqa: E402


def _check(results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--results", str(results)],
                          capture_output=True, text=True, timeout=120)


def test_results_md_matches_its_raw_files() -> None:
    res = _check(REPO / "bench" / "RESULTS.md")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr


def test_an_edited_number_in_a_block_fails_the_check(tmp_path: Path) -> None:
    text = (REPO / "bench" / "RESULTS.md").read_text()
    assert "**1.91 MiB/min**" in text
    edited = tmp_path / "RESULTS.md"
    edited.write_text(text.replace("**1.91 MiB/min**", "**1.75 MiB/min**"))
    res = _check(edited)
    assert res.returncode == 1 and "-RSS 680.4 MiB" in res.stdout and "+RSS 680.4 MiB" in res.stdout


def test_every_block_is_registered_and_every_entry_used() -> None:
    text = (REPO / "bench" / "RESULTS.md").read_text()
    with pytest.raises(KeyError, match="not in REGISTRY"):
        results_tables.render(text + "\n<!-- results_tables: nope -->\nx\n<!-- /results_tables -->\n")
    first = next(iter(results_tables.REGISTRY))
    start = text.index(f"<!-- results_tables: {first} -->")
    end = text.index("<!-- /results_tables -->", start) + len("<!-- /results_tables -->")
    with pytest.raises(KeyError, match="without a block"):
        results_tables.render(text[:start] + text[end:])
