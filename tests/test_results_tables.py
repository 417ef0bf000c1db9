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


def _fp8b_file(tmp_path: Path) -> Path:
    import json

    row = {"shape": "S", "M": 1, "route": "ours", "flashinfer_cutlass_us": 30.0, "flashinfer_cutlass_l2cold_us": 40.0,
           "vllm_triton_us": 25.0, "vllm_triton_l2cold_us": 36.0, "ours_us": 20.0, "ours_l2cold_us": 32.0,
           "served_us": 20.0, "served_l2cold_us": 32.0}
    meta = {"device": "H200", "flashinfer": "0.6.14", "vllm": "0.26.0"}
    path = tmp_path / "fp8_backends.json"
    path.write_text(json.dumps({"meta": meta, "rows": [row]}))
    return path


def test_l2_table_shows_warm_and_flushed_times(tmp_path: Path) -> None:
    import results_render_fp8

    rows = results_render_fp8.fp8_backends_l2(_fp8b_file(tmp_path))
    assert rows[-1] == "| S | 1 | 30.0 | 40.0 | 25.0 | 36.0 | 20.0 | 32.0 | 1.50x | 1.25x |"


def test_moe_share_predicts_from_the_chosen_kernel_times(tmp_path: Path) -> None:
    import json

    import results_render_fp8

    kernels = _fp8b_file(tmp_path)
    for v, tok_s in (("stock", 400.0), ("moe-serve", 440.0)):       # steps of 2.5 and 2.2727 ms
        (tmp_path / f"run-r0-{v}.json").write_text(json.dumps(
            {"variant": v, "round": 0, "rows": [{"B": 1, "tok_s": tok_s, "step_ms": 1e3 / tok_s}]}))
    warm = results_render_fp8.moe_share("S", "fp8", 10, kernels, tmp_path)
    cold = results_render_fp8.moe_share("S", "fp8", 10, kernels, tmp_path, timing="_l2cold_us")
    # warm: 10 x 30 us of a 2.5 ms step = 12 %, ours saves 10 x 10 us -> 2.5 / 2.4 = 1.042
    assert warm[2] == "| 1 | 2.500 | 12 % | 1.042 | 1.100 |"
    # flushed: 10 x 40 us = 16 %, saves 10 x 8 us -> 2.5 / 2.42 = 1.033
    assert cold[2] == "| 1 | 2.500 | 16 % | 1.033 | 1.100 |"


def test_moe_bound_from_a_profiled_stock_run(tmp_path: Path) -> None:
    import gzip
    import json

    import decode_profile
    import results_render_fp8

    def summary(name: str, steps: int) -> dict:       # per step: 600 us of MoE, 400 us of other
        ev = [{"ph": "X", "cat": "kernel", "name": n, "ts": 1000.0 * i + t0, "dur": d}
              for i in range(steps) for n, t0, d in (("fused_moe_kernel", 0, 600.0), ("attn", 600, 400.0))]
        path = tmp_path / f"{name}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": ev}, f)
        return decode_profile.summarize_trace(path)

    prof = {"1": {"tokens": [2, 6], "short": summary("s", 2), "long": summary("l", 6)}}
    run = {"variant": "stock", "round": 0, "rows": [{"B": 1, "tok_s": 800.0, "step_ms": 1.25}], "profile": prof}
    (tmp_path / "run-r0-stock.json").write_text(json.dumps(run))
    kernels = tmp_path / "k.json"          # a bench_kernels.py file: ours 1.2x vLLM's at M = 1
    kernels.write_text(json.dumps({"bench": [{"shape": "S", "dtype": "bf16", "M": 1, "vllm_us": 30.0,
                                              "served_speedup": 1.2}]}))
    rows = results_render_fp8.moe_bound("S", "bf16", kernels, tmp_path)
    # share 0.6 / 1.25 = 48 %; bound 1 / (1 - 0.48 * (1 - 1/1.2)) = 1 / 0.92 = 1.087
    assert rows[2:] == ["| 0 | 1 | 1.250 | 0.600 | 48 % | 1.200 | 1.087 |"]
