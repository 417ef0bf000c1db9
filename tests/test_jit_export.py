"""Worker report files -> API registry: sums over workers, restarts keep counts, info metric."""
from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kernels import jit_export as je


def _write(d: Path, pid: int, rank: int, jit: dict, mode: str = "optimized", phase: str = "serving",
           calls: dict | None = None, backend: str = "triton") -> None:
    rep = je.WorkerReport(d, plugin_loaded=True, mode=mode, hooks=["TritonExperts.apply"], phase=phase,
                          jit_monitor=True)
    rep.data.update(pid=pid, rank=rank, moe_calls=calls or {},
                    kernel_info={"backend": backend, "swap_ab": "true", "dtype": "bf16", "tp_size": 2})
    rep.set_jit(jit)
    os.replace(rep.path, d / f"worker-{pid}.json")  # the file name is the writer's pid; fake others


def _scrape(d: Path) -> dict[str, list]:
    reg = CollectorRegistry()
    reg.register(je.WorkerCollector(d))
    return {f.name: f.samples for f in text_string_to_metric_families(generate_latest(reg).decode())}


def _value(fams, name, **labels) -> float | None:
    """Sum of the family's samples whose labels include `labels` (None if there are none)."""
    vals = [s.value for s in fams.get(name, [])
            if (s.name.endswith("_total") or not name.startswith("moe_serve_triton_jit"))
            and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(vals) if vals else None


def test_sums_over_workers_and_keeps_restarted_workers(tmp_path: Path) -> None:
    k = "fused_moe_kernel"
    _write(tmp_path, 101, 0, {(k, "warmup", "compile"): 3, (k, "serving", "compile"): 1,
                              (k, "serving", "cache_load"): 2})
    _write(tmp_path, 102, 1, {(k, "warmup", "compile"): 3})
    _write(tmp_path, 103, 1, {(k, "warmup", "compile"): 4, (k, "serving", "compile"): 2})  # rank 1 restarted
    fams = _scrape(tmp_path)
    assert _value(fams, "moe_serve_triton_jit_compiles", kernel=k, phase="warmup") == 10
    assert _value(fams, "moe_serve_triton_jit_compiles", kernel=k, phase="serving") == 3
    assert _value(fams, "moe_serve_triton_jit_cache_loads", kernel=k, phase="serving") == 2
    assert _value(fams, "moe_serve_triton_jit_compiles", kernel=k, phase="warmup", rank="0") == 3
    assert _value(fams, "moe_serve_triton_jit_compiles", kernel=k, phase="warmup", rank="1") == 7
    assert _value(fams, "moe_serve_triton_jit_compiles", kernel=k, phase="serving", rank="1") == 2
    assert len(fams["moe_serve_vllm_worker_info"]) == 3


def test_info_metric_dedupes_and_launches_sum(tmp_path: Path) -> None:
    _write(tmp_path, 1, 0, {}, calls={"optimized": 5, "fallback": 1})
    _write(tmp_path, 2, 1, {}, calls={"optimized": 7})
    fams = _scrape(tmp_path)
    info = [s.labels for s in fams["moe_serve_moe_kernel_info"]]
    assert info == [{"backend": "triton", "swap_ab": "true", "dtype": "bf16", "tp_size": "2", "mode": "optimized"}]
    launches = {s.labels["path"]: s.value for s in fams["moe_serve_moe_kernel_launches"] if s.name.endswith("_total")}
    assert launches == {"optimized": 12, "fallback": 1}


def test_partial_or_foreign_files_are_skipped(tmp_path: Path) -> None:
    _write(tmp_path, 1, 0, {("a", "warmup", "compile"): 1})
    (tmp_path / "worker-2.json").write_text('{"pid": 2, "jit": [')  # torn write from a crash
    (tmp_path / "other.json").write_text(json.dumps({"jit": [{"kernel": "a", "phase": "warmup",
                                                              "kind": "compile", "count": 9}]}))
    assert _value(_scrape(tmp_path), "moe_serve_triton_jit_compiles", kernel="a", phase="warmup") == 1


def test_prepare_runtime_dir_clears_stale_reports(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(je.RUNTIME_DIR_ENV, str(tmp_path / "rt"))
    d = je.prepare_runtime_dir()
    (d / "worker-5.json").write_text("{}")
    assert je.prepare_runtime_dir() == d and not list(d.glob("worker-*.json"))
    monkeypatch.delenv(je.RUNTIME_DIR_ENV)
    fresh = je.prepare_runtime_dir()
    assert fresh.is_dir() and os.environ[je.RUNTIME_DIR_ENV] == str(fresh)


def test_counts_flush_in_background(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(je, "FLUSH_INTERVAL_S", 0.05)
    rep = je.WorkerReport(tmp_path, mode="optimized")
    rep.count("moe_calls", "optimized", 3)
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if rep.path.exists() and json.loads(rep.path.read_text())["moe_calls"].get("optimized") == 3:
            break
        time.sleep(0.05)
    assert json.loads(rep.path.read_text())["moe_calls"] == {"optimized": 3}


def test_summary_keeps_each_ranks_compiles(tmp_path: Path) -> None:
    k = "fused_moe_kernel"
    _write(tmp_path, 11, 0, {(k, "warmup", "compile"): 2, (k, "serving", "cache_load"): 5})
    _write(tmp_path, 12, 1, {(k, "warmup", "compile"): 3, (k, "serving", "compile"): 1})
    s = je.summary(tmp_path)
    assert [(w["rank"], w["jit_compiles"]) for w in s["workers"]] == [
        (0, {f"{k}|warmup": 2}), (1, {f"{k}|serving": 1, f"{k}|warmup": 3})]
    assert s["jit_compiles"] == {f"{k}|serving": 1, f"{k}|warmup": 5}
