"""`moe-serve bench serve` end to end on the vLLM CPU engine: the three real servers (vLLM's OpenAI
server, moe-serve with vLLM's kernels, moe-serve) on the embedded model's weights with the bench
models' word-level tokenizer (bench/model_dirs.py), one process each, levels c = 1 and 2, profiled,
answers compared; the run record (environment, vLLM's MoE table and its log) checked as `verify`
does; then the same command again (resume: no server starts) and the report."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve.bench.model_dirs import write_word_tokenizer
from moe_serve.bench.serve import verify
from moe_serve.bench.serve.answers import PROMPT_TOKENS, PROMPTS
from moe_serve.bench.serve.run_env import ROUTING_ENV
from moe_serve.bench.serve.servers import BASELINE, FRONTEND, OURS, VARIANTS, config_differences
from moe_serve.bench.serve.schedule import warmup_pass_count

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--processes", "1", "--frontend-every", "1", "--concurrency", "1,2",
        "--prompt-tokens", "32", "--output-tokens", "8", "--requests-per-level", "4",
        "--profile", "--profile-levels", "1,2", "--profile-tokens", "4,12"]


def _serve_ab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_serve.service", "bench", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's weights and config with the word-level tokenizer over its 32,000 ids."""
    from moe_serve.service.embedded_model import ensure_embedded_model

    src, d = ensure_embedded_model(), tmp_path_factory.mktemp("words") / "tiny-words"
    d.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(src / name, d / name)
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    write_word_tokenizer(d, json.loads((d / "config.json").read_text())["vocab_size"])
    return d


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("serve_ab")
    res = _serve_ab("--model-dir", str(model_dir), *ARGS, "--out", str(out))
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    return out


def _records(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "requests.jsonl").read_text().splitlines()]


def test_every_variant_ran_once_with_its_files(run_dir: Path) -> None:
    for v in VARIANTS:
        d = run_dir / v / "r0"
        assert (d / "complete").is_file() and (d / "server.log").stat().st_size > 0
        meta = json.loads((d / "meta.json").read_text())
        assert meta["variant"] == v and meta["exit_code"] == 0 and meta["start"] < meta["ready"] < meta["end"]
        assert meta["gpu"] == "cpu" and meta["copy_ceiling_bps"] is None and meta["vllm"] and meta["torch"]
        assert meta["host"] and len(meta["commit"]) == 40 and meta["dirty"] in (True, False)
        assert meta["workload"]["engine"]["kv_cache_memory_bytes"] == 512 * 1024 ** 2
        assert set(meta["floor_bytes"]) == {"1", "2"} and meta["floor_bytes"]["2"] > meta["floor_bytes"]["1"]
        assert meta["workload"]["engine"]["routing"] == "weights" and meta["workload"]["prompt_vocab"] == 32000
    configs = {v: json.loads((run_dir / v / "r0" / "meta.json").read_text())["engine_config"] for v in VARIANTS}
    assert all(c and c["max_seq_len"] == "4096" for c in configs.values()), configs   # what each engine resolved
    assert config_differences(configs[BASELINE], configs[OURS]) == {}
    assert config_differences(configs[BASELINE], configs[FRONTEND]) == {}
    argv = {v: json.loads((run_dir / v / "r0" / "meta.json").read_text())["argv"] for v in VARIANTS}
    versions = {v: json.loads((run_dir / v / "r0" / "version.json").read_text()) for v in VARIANTS}
    assert all(versions[v]["version"] for v in VARIANTS)
    counters = {v: (run_dir / v / "r0" / "moe_metrics.txt").read_text() for v in VARIANTS}
    assert counters[BASELINE] == ""                  # vllm serve exports no moe_serve_* samples
    for v in (FRONTEND, OURS):
        lines = counters[v].splitlines()
        assert lines and all(line.startswith("moe_serve_") for line in lines), counters[v][:500]
    assert argv[BASELINE][0] == "vllm.entrypoints.openai.api_server"
    assert argv[BASELINE][argv[BASELINE].index("--model") + 1].endswith("tiny-words")
    assert "--kv-cache-memory-bytes" in argv[BASELINE] and "--gpu-memory-utilization" not in argv[BASELINE]
    assert argv[FRONTEND][:1] == argv[OURS][:1] == ["moe_serve.service"]
    assert argv[FRONTEND][argv[FRONTEND].index("--moe-kernels") + 1] == "vllm"
    assert argv[OURS][argv[OURS].index("--moe-kernels") + 1] == "optimized"


def test_the_record_holds_the_environment_and_vllms_moe_table_as_verify_checks(run_dir: Path) -> None:
    """On the CPU engine vLLM's MoE backend is CPU: its default (no table for device "cpu") is
    recorded, and the log names no table. Every check of verify passes but the source's, which
    holds only where the tree is committed (CI's clean clone)."""
    cache: dict[str, str | None] = {}
    for v in VARIANTS:
        d = run_dir / v / "r0"
        meta = json.loads((d / "meta.json").read_text())
        env = meta["environment"]["env"]
        assert env[ROUTING_ENV] == "" and "MOE_SERVE_RUNTIME_DIR" not in env and meta["driver"] is None
        assert env["VLLM_PLUGINS"] == "" if v == BASELINE else env["MOE_SERVE_BLOCK_PDL"] == "0"
        assert meta["vllm_moe_table"] == {"device_name": "cpu", "tables": [
            {"file": "E=8,N=512,device_name=cpu.json", "source": "default", "path": None, "sha256": None}]}
        seen = meta["vllm_moe_table_logged"]
        assert seen["loaded"] == seen["default"] == [] and meta["backends"]["moe"] == "CPU"
        said = verify.problems(d, meta, cache)
        assert [p for p in said if not p.startswith(("source: ", "dirty: "))] == [], said
        assert ("dirty: ran from a tree with uncommitted changes" in said) == (meta["dirty"] is True)
    assert verify.run_problems({v: json.loads((run_dir / v / "r0" / "meta.json").read_text()) for v in VARIANTS}) == []


def test_api_process_cpu_is_recorded_per_timed_level(run_dir: Path) -> None:
    """Each timed level: its 4 warm-up and 4 measured requests of 8 tokens, the API process's CPU."""
    for v in VARIANTS:
        spent = json.loads((run_dir / v / "r0" / "api_cpu.json").read_text())
        assert set(spent) == {"1", "2"}
        for x in spent.values():
            assert (x["requests"], x["output_tokens"]) == (8, 64) and 0 < x["cpu_s"] < 60


def test_requests_have_the_fixed_shape_and_their_token_gaps(run_dir: Path) -> None:
    for v in VARIANTS:
        recs = _records(run_dir / v / "r0")
        for c in (1, 2):
            at = [r for r in recs if r["level"] == c]
            warm = 4 + warmup_pass_count(c)          # the untimed pass over every level, then the level's own
            assert [r["phase"] for r in at].count("warmup") == warm and [r["phase"] for r in at].count("measured") == 4
            assert sorted(r["index"] for r in at if r["phase"] == "measured") == [4, 5, 6, 7]
            assert [r["phase"] for r in at].count("profile-short") == c == [r["phase"] for r in at].count("profile-long")
        for r in recs:
            assert r["status"] == "ok", r["error"]
            assert (r["prompt_tokens"], r["output_tokens"]) == (32, r["max_tokens"])
            assert len(r["itl_us"]) == r["chunks"] - 1 and all(g >= 0 for g in r["itl_us"])
            assert 0 <= r["t_start"] < r["t_first"] <= r["t_end"]


def test_profiles_hold_the_engines_traces_summaries_and_no_raw_trace(run_dir: Path) -> None:
    for v in VARIANTS:
        d = run_dir / v / "r0"
        prof = json.loads((d / "profile.json").read_text())
        assert sorted(prof["levels"]) == ["1", "2"]
        for level in prof["levels"].values():
            assert level["tokens"] == [4, 12] and level["wall_s"]["long"] > 0
            # a CPU engine runs no GPU kernels; its trace's CPU ops show the engine was recorded,
            # more of them in the burst with more decode steps
            assert level["short"]["kernels"] == {} and level["short"]["ranks"] == 1
            assert 0 < level["short"]["cpu_ops"] < level["long"]["cpu_ops"]
        assert not (d / "traces").exists() and not (d / "kept-traces").exists()


def test_the_same_command_resumes_without_starting_a_server(run_dir: Path, model_dir: Path) -> None:
    logs = {v: (run_dir / v / "r0" / "server.log").stat().st_mtime_ns for v in VARIANTS}
    res = _serve_ab("--model-dir", str(model_dir), *ARGS, "--out", str(run_dir))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 processes to run" in res.stdout and "process 1/" not in res.stdout
    assert logs == {v: (run_dir / v / "r0" / "server.log").stat().st_mtime_ns for v in VARIANTS}


def test_every_server_answered_the_fixed_prompts_teacher_forced(run_dir: Path) -> None:
    for v in VARIANTS:
        said = json.loads((run_dir / v / "r0" / "answers.json").read_text())
        assert len(said["prompts"]) == PROMPTS
        assert all(len(p["logprob"]) == len(p["top1"]) == PROMPT_TOKENS - 1 for p in said["prompts"])
        assert all(x <= 0 for p in said["prompts"] for x in p["logprob"])


def test_report_renders_every_cell_and_the_profile(run_dir: Path) -> None:
    res = _serve_ab("report", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("`vllm serve`'s MoE table: default (untuned: no `E=8,N=512,device_name=cpu.json`) (the server log agrees "
            "in 1 of 1); MoE backend CPU: reads no table.") in res.stdout
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| tiny-words |")]
    ab = [ln.split(" | ") for ln in rows if ln.count("|") == 12]
    assert [(r[1], r[2], r[3]) for r in ab] == [(c, v, "1") for c in ("1", "2") for v in VARIANTS]
    for r in ab:
        assert float(r[4].strip("*")) > 0 and float(r[8].strip("*")) > 0
        assert r[5] == "—" if r[2] == BASELINE else r[5].endswith("[n/a]")   # one process: no interval
        assert r[10] == "— |"                                                   # CPU: no byte floor
    assert len([ln for ln in rows if ln.count("|") == 17]) == 6                 # profile: 3 variants x 2 levels
    said = [ln.split(" | ") for ln in rows if ln.count("|") == 7 and " | 1 | " + str(PROMPTS * (PROMPT_TOKENS - 1)) in ln]
    assert sorted(r[1] for r in said) == sorted([FRONTEND, OURS])   # against vllm-serve's one process
    assert all(float(r[4]) >= 0.9 for r in said), said         # the same engine on the CPU: the same answers
