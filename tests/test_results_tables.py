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


def test_process_times_reads_the_phases_from_the_log_clock(tmp_path: Path) -> None:
    import json

    import results_render_fp8

    run = {"variant": "stock", "round": 0, "start_s": 60.4, "import_s": 12.3, "wall_s": 90.0,
           "ended": 1.0, "rows": [{"B": 1, "tok_s": 1.0, "step_ms": 1.0}]}
    (tmp_path / "run-r0-stock.json").write_text(json.dumps(run))
    (tmp_path / "run-r0-stock.log").write_text(
        "INFO 12-01 10:00:20 [api_utils.py:273] non-default args: {}\n"
        "(EngineCore pid=1) INFO 12-01 10:00:45 [core.py:116] Initializing a V1 LLM engine\n"
        "[probe 10:01:00] engine up in 60.4 s\n[probe 10:01:05] B=1: step\n[probe 10:01:20] B=8: step\n")
    rows = results_render_fp8.process_times(tmp_path)
    # the process started 60.4 s before engine up (10:01:00): at 09:59:59.6
    assert rows[2] == "| 1 | 0 | stock | 12 | 20 | 45 | 60 | 80 | 90 |"
