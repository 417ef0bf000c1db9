"""bench/e2e_ab.py pieces that run on CPU: model dirs (config + tokenizer) and the time plan."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from loadtest.server_proc import REPO


def load_driver():
    spec = importlib.util.spec_from_file_location("e2e_ab", REPO / "bench" / "e2e_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["mixtral-8x7b", "mixtral-8x7b-tp8-rank-at-tp2", "qwen3-30b-a3b",
                                  "qwen3-30b-a3b-tp8-rank", "qwen3-30b-a3b-fp8-block", "qwen3-30b-a3b-fp8-dynamic"])
def test_model_configs_use_the_mixtral_tokenizer_vocab(name: str) -> None:
    cfg = json.loads((REPO / "bench" / "models" / name / "config.json").read_text())
    assert cfg["vocab_size"] == 32000 and cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2


def test_tp2_stand_in_gives_each_rank_the_tp8_rank_shapes() -> None:
    """At --tensor-parallel-size 2 each rank of mixtral-8x7b-tp8-rank-at-tp2 must run the MoE and
    attention shapes of one TP=8 rank (the shapes the tuned tables and routing are keyed by)."""
    def cfg(name: str) -> dict:
        return json.loads((REPO / "bench" / "models" / name / "config.json").read_text())

    rank, at_tp2 = cfg("mixtral-8x7b-tp8-rank"), cfg("mixtral-8x7b-tp8-rank-at-tp2")
    split = ("intermediate_size", "num_attention_heads", "num_key_value_heads")
    assert {k: at_tp2[k] // 2 for k in split} == {k: rank[k] for k in split}
    assert {k: v for k, v in at_tp2.items() if k not in split} == {k: v for k, v in rank.items() if k not in split}


def test_prepare_model_writes_tokenizer_and_dummy_load(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    drv = load_driver()
    model_dir, args = drv.prepare_model("mixtral-8x7b", tmp_path)
    assert args == ["--engine-arg", 'load_format="dummy"']
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 32000 and tok.encode("hello world")
    assert json.loads((Path(model_dir) / "config.json").read_text())["model_type"] == "mixtral"


def _fake_run(root: Path, tok_s: dict[str, float], ttft_s: dict[str, list[float]]) -> Path:
    """A run dir as e2e_ab.py writes it: one stage per scenario, requests with the given TTFTs."""
    for v in ("optimized", "vllm"):
        for sc in ("spike-sizes", "step"):
            d = root / v / sc
            d.mkdir(parents=True)
            stage = {"users": 4, "output_tok_s": tok_s[v], "itl_p50_ms": 10.0 / tok_s[v], "ttft_p50_ms": 20.0}
            comp = {"total": 0 if v == "optimized" else 3, "per_kernel": {}}
            (d / "report.json").write_text(json.dumps({"stages": [stage], "serving_jit_compiles": comp}))
            recs = [{"status": "ok", "ttft": t} for t in ttft_s[v]] + [{"status": "error", "ttft": None}]
            (d / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    return root


def test_pool_ratios_and_geomean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("e2e_pool", REPO / "bench" / "e2e_pool.py")
    pool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool)
    ttft = {"optimized": [0.01 * i for i in range(1, 101)], "vllm": [0.02 * i for i in range(1, 101)]}
    r1 = _fake_run(tmp_path / "r1", {"optimized": 110.0, "vllm": 100.0}, ttft)
    r2 = _fake_run(tmp_path / "r2", {"optimized": 90.0, "vllm": 100.0}, ttft)
    assert pool.main([str(r1), str(r2)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["1.100", "0.900"]                  # tok/s ratio per run
    assert cells[7] == f"**{(1.1 * 0.9) ** 0.5:.3f}**"       # geomean 0.995
    assert cells[3:5] == [f"{1 / 1.1:.3f}", f"{1 / 0.9:.3f}"]  # ITL ratio is the inverse here
    assert "| 1 | optimized | 100 | 510.0 | 1000.0 | 1000.0 | 0 |" in out  # the error request is left out
    assert "| 2 | vllm | 100 | 1020.0 | 2000.0 | 2000.0 | 3 |" in out


def test_ttft_p50_pooled_over_runs_with_a_t_interval(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("e2e_pool", REPO / "bench" / "e2e_pool.py")
    pool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool)
    base = [0.01 * i for i in range(1, 101)]                      # p50 (index 50) = 0.51 s
    runs = [_fake_run(tmp_path / f"r{k}", {"optimized": 1.0, "vllm": 1.0},
                      {"optimized": [t * f for t in base], "vllm": base + [1.5]})  # one stall > 1 s
            for k, f in enumerate((0.8, 0.9))]
    lines = pool.ttft_p50_pooled(runs, "spike-sizes")
    row0 = [c.strip() for c in lines[2].strip("|").split("|")]
    assert row0[1:5] == ["100 / 101", f"{510 * 0.8:.1f}", "510.0", "0.800"]   # p50: index n // 2
    assert row0[5:] == ["0.0 %", f"{100 / 101:.1f} %"]
    g = (0.8 * 0.9) ** 0.5
    assert f"geomean **{g:.3f}**" in lines[-1]
    lo, hi = map(float, re.search(r"\[([\d.]+), ([\d.]+)\]", lines[-1]).groups())
    assert lo < g < hi
    assert "one run" in pool.ttft_p50_pooled(runs[:1], "spike-sizes")[-1]


def test_tables_only_joins_variants_run_in_separate_calls(tmp_path: Path) -> None:
    """An A/B split over two invocations: each leaves variant-<v>.json and its scenario
    reports; --tables-only writes the ratio tables and the per-rank compile line from them."""
    drv = load_driver()
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "req_s")
    for v, tok_s, serving in (("vllm", 100.0, 4), ("optimized", 125.0, 0)):
        workers = [{"rank": r, "jit_compiles": {"fused_moe_kernel|warmup": 3, "fused_moe_kernel|serving": serving}}
                   for r in (0, 1)]
        result = {"variant": v, "model": "m-at-tp2", "ready_s": 140.0, "workers": workers}
        (tmp_path / f"variant-{v}.json").write_text(json.dumps(result))
        for sc in ("spike-sizes", "step"):
            stage = {"label": "u4", "users": 4, "requests": 10, "errors": 0, **{k: tok_s for k in keys}}
            comp = {"total": 2 * serving, "per_kernel": {"fused_moe_kernel": 2 * serving} if serving else {}}
            (tmp_path / v / sc).mkdir(parents=True)
            (tmp_path / v / sc / "report.json").write_text(json.dumps(
                {"meta": {"scenario": {"name": sc}}, "stages": [stage], "serving_jit_compiles": comp}))
    assert drv.main(["--out", str(tmp_path), "--tables-only"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# e2e A/B: m-at-tp2, A = vllm, B = optimized")
    assert "Workers of vllm: 2 reporting; serving-phase compiles rank 0: 4, rank 1: 4" in summary
    assert "Workers of optimized: 2 reporting; serving-phase compiles rank 0: 0, rank 1: 0" in summary
    assert summary.count("| u4 | 4 | 0/0 | 100.0 | 125.0 | 1.250 |") == 2  # both scenarios, B/A = 1.25
    (tmp_path / "variant-optimized.json").unlink()
    assert drv.main(["--out", str(tmp_path), "--tables-only"]) == 1
    assert "variants ['optimized'] failed or missing" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize(("rank_model", "whole", "shard"), [("mixtral-8x7b-tp8-rank", "mixtral-8x7b", "Mixtral-8x7B/TP8"),
                                                            ("qwen3-30b-a3b-tp8-rank", "qwen3-30b-a3b", "Qwen3-30B-A3B/TP8")])
def test_tp8_rank_models_run_one_tp8_rank_moe_shape(rank_model: str, whole: str, shard: str) -> None:
    """A '-tp8-rank' model at TP=1 runs the MoE shape one rank of the whole model runs at TP=8:
    the tuned shard of bench/shapes.py, so its decode A/B exercises that shard's tables."""
    import sys

    from kernels.tuning.model_shapes import moe_shapes, read_config
    sys.path.insert(0, str(REPO / "bench"))
    from shapes import TUNED

    def key(name: str, tp: int) -> tuple:
        (shape,) = moe_shapes(read_config(REPO / "bench" / "models" / name), tp=tp)
        return shape.key

    assert key(rank_model, 1) == key(whole, 8) == TUNED[shard]


@pytest.mark.parametrize("name,key", [("qwen3-30b-a3b-fp8-block", "fp8_w8a8,block_shape=[128,128]"),
                                      ("qwen3-30b-a3b-fp8-dynamic", "fp8_w8a8,per_token")])
def test_fp8_stand_ins_are_the_bf16_model_with_a_checkpoints_format(name: str, key: str) -> None:
    """The FP8 bench models differ from qwen3-30b-a3b only by quantization_config, whose format our
    tables key on, and keep every MoE gate unquantized as the published checkpoints do."""
    from kernels.moe import quant_format

    base = json.loads((REPO / "bench" / "models" / "qwen3-30b-a3b" / "config.json").read_text())
    cfg = json.loads((REPO / "bench" / "models" / name / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == base and quant_format.of_checkpoint(qc) == key
    ignored = qc.get("modules_to_not_convert") or qc.get("ignore")
    gates = [f"model.layers.{i}.mlp.gate" for i in range(base["num_hidden_layers"])]
    assert set(gates) <= set(ignored) or "re:.*mlp.gate$" in ignored


@pytest.mark.parametrize(("name", "shard"), [("deepseek-v3-fp8-block", "DeepSeek-V3/TP8"),
                                             ("qwen3-235b-a22b-fp8-block", "Qwen3-235B-A22B/TP8")])
def test_block_fp8_tp8_models_give_the_format_bench_shards(name: str, shard: str) -> None:
    """`moe-serve tune --model bench/models/<name> -tp 8` tunes the block-FP8 shard that
    bench_kernels --format-bench times (bench/kernels_fp8.FORMAT_SHAPES), in block FP8."""
    import sys

    from kernels.moe import quant_format
    from kernels.tuning.model_shapes import moe_shapes, read_config
    sys.path.insert(0, str(REPO / "bench"))
    from kernels_fp8 import FORMAT_SHAPES

    (shape,) = moe_shapes(read_config(REPO / "bench" / "models" / name), tp=8)
    assert shape.key == FORMAT_SHAPES[shard]
    assert shape.dtype == quant_format.block_key(128, 128)
