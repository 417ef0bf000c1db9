"""The generated blocks of bench/RESULTS.md, bench/HISTORY.md and README.md match the committed raw
files (bench/results_tables.py), and the renderers of RESULTS.md's opening compute what they say."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import results_tables  # noqa: E402


def test_every_document_matches_its_raw_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert results_tables.main(["--check"]) == 0, capsys.readouterr().out[-4000:]
    assert "RESULTS.md, HISTORY.md, README.md: " in capsys.readouterr().out


def test_an_edited_number_in_a_block_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edits = {REPO / "bench" / "HISTORY.md": ("**1.91 MiB/min**", "**1.75 MiB/min**"),
             REPO / "README.md": ("**1.080** [1.019, 1.146]", "**1.180** [1.019, 1.146]")}
    docs = []
    for doc in results_tables.DOCS:
        if doc in edits:
            old, new = edits[doc]
            text = doc.read_text()
            assert old in text
            doc = tmp_path / doc.name
            doc.write_text(text.replace(old, new))
        docs.append(str(doc))
    assert results_tables.main(["--check", *docs]) == 1
    out = capsys.readouterr()
    assert "-RSS 680.4 MiB" in out.out and "+RSS 680.4 MiB" in out.out           # HISTORY.md's soak block
    assert "-- Decode throughput" in out.out and "+- Decode throughput" in out.out   # the README's headline
    assert "HISTORY.md differs" in out.err and "README.md differs" in out.err


def test_every_block_is_registered_and_every_entry_used() -> None:
    texts = {d: d.read_text() for d in results_tables.DOCS}
    nope = "<!-- results_tables: nope -->\nx\n<!-- /results_tables -->\n"
    with pytest.raises(KeyError, match="not in REGISTRY"):
        results_tables.render({**texts, Path("x.md"): nope})
    results_md = results_tables.DOCS[0]
    text = texts[results_md]
    start = text.index("<!-- results_tables: now-kernels -->")
    end = text.index("<!-- /results_tables -->", start) + len("<!-- /results_tables -->")
    with pytest.raises(KeyError, match=r"without a block.*now-kernels"):
        results_tables.render({**texts, results_md: text[:start] + text[end:]})


def test_results_opens_with_the_current_answer_and_history_is_newest_first() -> None:
    results = (REPO / "bench" / "RESULTS.md").read_text()
    opening = results[:results.index("## Details")]
    assert re.findall(r"<!-- results_tables: ([\w-]+) -->", opening) == [
        "serve-ab-fp8-dynamic-headline", "serve-ab-fp8-block-headline", "serve-ab-headline", "serve-ab",
        "serve-ab-session17", "router-kernel", "moe-block", "attention", "format-bench-fp8",
        "serve-ab-fp8-block", "gemv", "prefetch", "prefetch-refined", "serve-ab-fp8-dynamic", "tune-fp8-dynamic", "fp8-aligned", "now-decode-ab", "now-kernels", "now-tune-times"]
    readme = (REPO / "README.md").read_text()
    first_screen = readme[:readme.index("## Talking to it")]
    assert re.findall(r"<!-- results_tables: ([\w-]+) -->", first_screen) == ["serve-ab-headline", "readme-headline"]
    assert not re.search(r"(?m)^## \d{4}-", results)              # no dated section left in RESULTS.md
    dates = re.findall(r"(?m)^## (\d{4}-\d\d-\d\d)", (REPO / "bench" / "HISTORY.md").read_text())
    assert len(dates) > 10 and dates == sorted(dates, reverse=True)


def test_process_times_reads_the_phases_from_the_log_clock(tmp_path: Path) -> None:
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


def _bench_row(shape: str, dtype: str, m: int, speedup: float, tuned: bool, **kw: float) -> dict:
    return {"shape": shape, "dtype": dtype, "M": m, "speedup": speedup, "tuned": tuned,
            "served_speedup": kw.get("served", max(speedup, 1.0)), "ours_vs_floor": kw.get("of", 1.5),
            "vllm_vs_floor": kw.get("vf", 1.5 * speedup)}


def test_kernel_shapes_takes_each_shape_from_its_newest_run(tmp_path: Path) -> None:
    import results_render_now as rn

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"bench": [_bench_row("S", "bf16", 1, 0.5, False),       # replaced by new.json
                                         _bench_row("T", "bf16", 1, 1.2, False, of=2.0, vf=2.4),
                                         _bench_row("T", "bf16", 64, 1.5, False, served=0.9)]}))
    new.write_text(json.dumps({"bench": [_bench_row("S", "bf16", 1, 1.0, True, of=1.1, vf=1.1),
                                         _bench_row("S", "bf16", 4, 4.0, True),
                                         _bench_row("S", "bf16", 128, 9.0, True)]}))          # M > 64: not in a geomean
    lines = rn.kernel_shapes(old, new)
    assert lines[2] == "| S | yes | 2.00 | 1.00 | 2.00 | 1.28 | 1.10 | 2.57 | 1.10 |"   # tuned first
    assert lines[3] == "| T | no | 1.34 | 1.20 | 1.04 | 1.73 | 2.00 | 2.32 | 2.40 |"
    assert "tuned bf16 **2.00x** (1 shapes); no table bf16 **1.34x** (1 shapes)" in lines[-1]
    assert "Lowest served cell at any M: 0.90x (T bf16 M = 64)" in lines[-1]
    assert f"`{old}` (1 shapes), `{new}` (1 shapes)" in lines[-1]


def test_tune_times_keep_the_newest_whole_tune_and_say_whether_vllm_was_timed(tmp_path: Path) -> None:
    import results_render_now as rn

    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text("[tune] m/TP8 E=8 N=1 K=2 topk=2 bf16: tuned in 30s; vs vLLM M=1 n/a, M=8 n/a\n"
                     "TUNE_TIME m tp8 bf16 39s\n"
                     "[tune] q/TP1 E=8 N=1 K=2 topk=2 fp8: tuned in 30s; vs vLLM M=1 n/a, M=8 n/a\n"
                     "TUNE_TIME q tp1 fp8 --no-vllm 48s\n")                        # a search-only phase
    second.write_text("[tune] q/TP1 E=8 N=1 K=2 topk=2 fp8: tuned in 50s; vs vLLM M=1 1.20x, M=8 0.97x\n"
                      "TUNE_TIME q tp1 fp8 with-vllm 78s\n")
    lines = rn.tune_times_now(first, second)
    assert lines[2:4] == ["| m | 8 | 39 s | n/a | no |", "| q | 1 | n/a | 78 s | yes |"]
    assert lines[-1] == f"Raw: `{first}`, `{second}`."


def _decode_runs(d: Path, gains: dict[str, list[float]]) -> Path:
    d.mkdir()
    for v, per_process in gains.items():
        for r, g in enumerate(per_process):
            rows = [{"B": b, "tok_s": 100.0 * b * g, "step_ms": 10.0 / g} for b in (1, 8)]
            (d / f"run-r{r}-{v}.json").write_text(json.dumps({"variant": v, "round": r, "model": "/x/m-fp8",
                                                              "prompts": "distinct", "temperature": 1.0,
                                                              "rows": rows}))
    return d


def test_decode_summary_bolds_only_ratios_whose_interval_lies_above_one(tmp_path: Path) -> None:
    import results_render_now as rn

    clear = _decode_runs(tmp_path / "clear", {"stock": [1.0, 1.01, 0.99], "moe-serve": [1.2, 1.21, 1.19]})
    noisy = _decode_runs(tmp_path / "noisy", {"stock": [1.0, 1.3, 0.8], "moe-serve": [1.1, 0.85, 1.3]})
    one = _decode_runs(tmp_path / "one", {"stock": [1.0], "moe-serve": [1.1]})
    lines = rn.decode_ab_summary((("moe-serve", "stock"),) * 3, (clear,), (noisy,), (one,))
    assert lines[0].startswith("| model (dummy weights) | batches | ratio | B = 1 | B = 8 | all B |")
    clear_row, noisy_row, one_row = (ln.split(" | ") for ln in lines[2:])
    assert clear_row[:3] == ["| `m-fp8`", "distinct sequences", "moe-serve / stock"]
    assert clear_row[3].startswith("**1.200** [") and clear_row[-1] == "3 / 3 |"
    assert noisy_row[3].startswith("1.0") and "**" not in " ".join(noisy_row)
    assert one_row[3] == "1.100 (one process)"


def test_headline_names_the_batches_and_the_tuned_shapes(tmp_path: Path) -> None:
    import results_render_now as rn

    fp8 = _decode_runs(tmp_path / "fp8", {"stock": [1.0, 1.01, 0.99], "moe-serve": [1.2, 1.21, 1.19]})
    bf16 = _decode_runs(tmp_path / "bf16", {"stock": [1.0, 1.3, 0.8], "moe-serve": [1.1, 0.85, 1.3]})
    kern = tmp_path / "k.json"
    kern.write_text(json.dumps({"bench": [_bench_row("S", "bf16", 1, 1.2, True), _bench_row("T", "bf16", 1, 0.9, True),
                                          _bench_row("U", "bf16", 1, 3.0, False)]}))    # untuned: not in the line
    lines = rn.headline((fp8,), (bf16,), kern)
    assert "FP8 (`m-fp8`): **1.200** [" in lines[0] and "over B = 1, 8 (distinct sequences, 3 processes" in lines[0]
    assert lines[1].endswith(f"bf16 {(1.2 * 0.9) ** 0.5:.2f}x (0.90-1.20x over 2 shapes).")
