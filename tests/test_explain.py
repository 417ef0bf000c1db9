"""`moe-serve explain`: per MoE shape of a model and M, the path, config and its source, the
measured ratio and the fallback, from the tables alone (no GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_serve.kernels.config import PluginConfig
from moe_serve.kernels.moe import configs, routing, selection
from moe_serve.kernels.moe.router_topk import max_tokens
from moe_serve.kernels.plugin import layer_plan, vllm_compat
from moe_serve.kernels.plugin.layer_plan import LayerFacts, PlanContext
from moe_serve.kernels.plugin.moe_hook import unsupported_reason
from moe_serve.kernels.tuning import explain
from moe_serve.kernels.tuning.model_shapes import moe_shapes, read_config

REPO = Path(__file__).resolve().parents[1]
SHIPPED_ROUTING = json.loads((configs.CONFIG_DIR / routing.file_name("NVIDIA_H200")).read_text())
SHIPPED_TRITON = SHIPPED_ROUTING["triton_version"]
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2,
           "intermediate_size": 14336, "hidden_size": 4096, "num_hidden_layers": 32,
           "torch_dtype": "bfloat16"}


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_SERVE_KERNEL_CONFIG_DIR", raising=False)
    monkeypatch.delenv(routing.ROUTING_ENV, raising=False)
    monkeypatch.setenv("MOE_SERVE_CACHE", str(tmp_path / "cache"))
    selection.clear_caches()
    yield
    selection.clear_caches()


def _model(tmp_path: Path, **extra) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**MIXTRAL, **extra}))
    return str(d)


def _rows(out: str) -> dict[int, str]:
    """M -> its row of the table (rows start with the M value)."""
    rows = {}
    for line in out.splitlines():
        first = line.split()[:1]
        if first and first[0].isdigit():
            rows[int(first[0])] = line
    return rows


def test_shipped_tables_per_m(tmp_path, capsys) -> None:
    rc = explain.main(["--model", _model(tmp_path), "-tp", "8", "--device", "NVIDIA_H200",
                       "--triton-version", SHIPPED_TRITON])
    out = capsys.readouterr().out
    assert rc == 0
    rows = _rows(out)
    assert sorted(rows) == list(configs.M_BUCKETS)
    measured = SHIPPED_ROUTING["shapes"]["E=8,N=1792,K=4096,dtype=bf16"]["measured"]
    assert "ours decode" in rows[1] and configs.SHIPPED in rows[1]
    assert f"{measured['1']['speedup']:.3f}x@M=1" in rows[1]
    for M, row in rows.items():
        s = selection.choose(8, 1792, 4096, 2, "bf16", M, "NVIDIA_H200", triton_version=SHIPPED_TRITON)
        assert row.split()[1:1 + len(s.path.split())] == s.path.split() and s.config.label in row
        assert (s.fallback or s.route.why) in row
    assert any(r.split()[1] == "vllm" and "routed to vLLM" in r for r in rows.values())
    assert "E=8 N=1792 K=4096 topk=2 bf16, 32 layers" in out and "vLLM MoE backend: triton" in out
    assert "router: ours (gate GEMM + top-k in one launch) at M <= 16, vLLM's above" in out   # 8 x 4096


def test_the_router_line_follows_the_measured_token_limit() -> None:
    def line(E: int, K: int) -> str:
        ctx = PlanContext(PluginConfig(), "cpu", None, "test")
        facts = LayerFacts(E, 768, K, 8, "bf16", router=layer_plan.config_router({}, E, K, 8))
        return layer_plan.build(facts, ctx).router_line()

    assert "at M <= 8, vLLM's above" in line(128, 2048)             # Qwen3-30B-A3B
    assert "at M <= 4, vLLM's above" in line(128, 4096)             # Qwen3-235B, GLM-4.5-Air
    assert "at every M" in line(1024, 8192)


@pytest.mark.parametrize("model", sorted(p.name for p in (REPO / "bench" / "models").iterdir()))
def test_every_bench_models_plan_is_what_explain_prints(model: str, capsys) -> None:
    """Each bench model's layer plans, built on this CPU for the H200's shipped tables: the
    experts' decision per M is selection's, the router follows the model's routing (grouped top-k:
    vLLM's; else ours up to the gate's token limit), and explain prints exactly these plans."""
    path = REPO / "bench" / "models" / model
    cfg = read_config(path)
    shapes = moe_shapes(cfg, 1, None, name=model)
    ctx = PlanContext(PluginConfig(), "NVIDIA_H200", SHIPPED_TRITON, explain.vllm_version())
    plans = explain.plans(cfg, shapes, ctx, None)
    ms = list(configs.M_BUCKETS)
    grouped = int(explain.router_config(cfg).get("n_group") or 1) > 1
    for plan in plans:
        f = plan.facts
        for M in ms:
            s = selection.choose(f.E, f.N, f.K, f.topk, f.fmt, M, "NVIDIA_H200", triton_version=SHIPPED_TRITON)
            assert (plan.select(M).path, plan.config(M)) == (s.path, s.config.config), (model, M)
        want = None if grouped else max_tokens(f.E, f.K)
        assert (plan.router.spec.max_m if plan.router.spec else None) == (want if want else None), model
    assert explain.main(["--model", str(path), "--device", "NVIDIA_H200", "--triton-version", SHIPPED_TRITON]) == 0
    out = capsys.readouterr().out
    for plan in plans:
        assert "\n".join(plan.lines(ms)) in out, model


def test_tables_of_another_triton_are_refused_and_defaults_shown(tmp_path, capsys) -> None:
    rc = explain.main(["--model", _model(tmp_path), "-tp", "8", "--device", "NVIDIA_H200",
                       "--triton-version", "0.0.1-other", "--m", "1,64"])
    out = capsys.readouterr().out
    assert rc == 0 and "refused: " in out and "made under Triton " + SHIPPED_TRITON in out
    rows = _rows(out)
    assert "default: decode-path heuristic" in rows[1]
    assert "default rule" in out and configs.SHIPPED not in rows[64]


def test_on_another_machine_a_triton_mismatch_is_explained_with_the_flag(tmp_path, capsys, monkeypatch) -> None:
    """Explaining for the H200 on a machine with another Triton: the refusal says which Triton made
    the tables and names --triton-version; given it, the shipped tables serve and the note goes."""
    monkeypatch.setattr(configs, "running_triton_version", lambda: "9.9.9-here")
    assert explain.main(["--model", _model(tmp_path), "-tp", "8", "--device", "NVIDIA_H200", "--m", "1"]) == 0
    out = capsys.readouterr().out
    assert f"made under Triton {SHIPPED_TRITON}; this machine has Triton 9.9.9-here" in out
    assert f"--triton-version {SHIPPED_TRITON}" in out
    assert explain.main(["--model", _model(tmp_path), "-tp", "8", "--device", "NVIDIA_H200", "--m", "1",
                         "--triton-version", SHIPPED_TRITON]) == 0
    out = capsys.readouterr().out
    assert "refused" not in out and "Triton: the refused tables" not in out and configs.SHIPPED in out


def test_block_fp8_layers_are_selected_as_their_format(tmp_path, capsys) -> None:
    """A block-FP8 checkpoint's layers are named by their format and follow selection's route
    (untuned: vLLM at every M, since the format has no default rule), and the hook accepts a
    block call with vLLM's scale layouts for where a tuned table routes them to ours."""
    model = _model(tmp_path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert explain.main(["--model", model, "--m", "1,64"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert "fp8_w8a8,block_shape=[128,128]" in out and explain.SCHEME_FALLBACKS == {}
    assert not any("unsupported by ours" in r for r in rows.values())
    assert rows[1].split()[1] == "vllm" and rows[64].split()[1] == "vllm"
    E, N, K, M, fp8 = 4, 128, 256, 2, torch.float8_e4m3fn
    quant = SimpleNamespace(use_fp8_w8a8=True, quant_dtype=fp8, block_shape=[128, 128],
                            per_act_token_quant=False, gemm1_clamp_limit=None, gemm1_alpha=None,
                            gemm1_beta=None)
    experts = SimpleNamespace(quant_config=quant, _lora_context=None, w1_bias=None, w2_bias=None,
                              quantization_emulation=False, block_shape=[128, 128],
                              per_act_token_quant=False, w1_scale=torch.ones(E, 2, 2),
                              w2_scale=torch.ones(E, 2, 1), a2_scale=None)
    call = vllm_compat.ApplyCall(torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(M, K, dtype=fp8),
                                 torch.zeros(E, 2 * N, K, dtype=fp8), torch.zeros(E, K, N, dtype=fp8),
                                 torch.ones(M, 2), torch.zeros(M, 2, dtype=torch.int32),
                                 SimpleNamespace(name="SILU"), -1, None, torch.ones(M, 2), None,
                                 torch.zeros(1), torch.zeros(1), None, False)
    assert unsupported_reason(experts, call, require_cuda=False) is None


def test_bad_models_exit_2(tmp_path, capsys) -> None:
    assert explain.main(["--model", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err
    gpt_oss = _model(tmp_path, architectures=["GptOssForCausalLM"])
    assert explain.main(["--model", gpt_oss]) == 2
    assert "vLLM's kernels serve it" in capsys.readouterr().err


def test_console_script_dispatches_explain(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "moe_serve.service", "explain", "--model", _model(tmp_path),
                          "--m", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(_rows(res.stdout)) == [1] and "moe-serve explain:" in res.stdout


def test_on_a_gpu_the_device_and_arch_come_from_it(tmp_path, capsys, monkeypatch) -> None:
    """Without --device the GPU's table name and compute capability are used (simulated H200)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert explain.main(["--model", _model(tmp_path), "-tp", "8", "--triton-version", SHIPPED_TRITON,
                         "--m", "1"]) == 0
    out = capsys.readouterr().out
    assert "on NVIDIA_H200, " in out and out.splitlines()[0].endswith("arch sm90")
    assert configs.SHIPPED in _rows(out)[1]


@pytest.mark.parametrize("fp8_dense_gemv", [False, True])
def test_dense_gemms_show_the_buckets_their_table_lists(fp8_dense_gemv: bool, capsys, monkeypatch) -> None:
    """Per dense GEMM: ours at the token counts the shipped H100 table lists (read from the table, not
    restated), vLLM's where its setting is off or no table lists the shape (with the command)."""
    from moe_serve.kernels.dense import configs as dense_configs
    from moe_serve.kernels.tuning.dense_shapes import dense_shapes

    if fp8_dense_gemv:
        monkeypatch.setenv("MOE_SERVE_FP8_DENSE_GEMV", "1")
    path = REPO / "bench" / "models" / "qwen3-30b-a3b-fp8-block"
    device = "NVIDIA_H100_80GB_HBM3"
    assert explain.main(["--model", str(path), "--device", device, "--triton-version", SHIPPED_TRITON]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out[out.index("dense GEMMs"):].splitlines()[1:] if ln.startswith("  ")}
    shapes = dense_shapes(read_config(path))
    assert set(lines) == {s.name for s in shapes}
    for s in shapes:
        table = dense_configs.find_table(s.N, s.K, s.fmt, device, triton_version=SHIPPED_TRITON).table
        ms = [m for m in dense_configs.BUCKETS if m <= dense_configs.max_m(s.fmt) and table and m in table]
        if dense_configs.is_fp8(s.fmt) and not fp8_dense_gemv:
            assert "fp8_dense_gemv is off" in lines[s.name]
        elif ms:
            assert f"ours at M in {{{', '.join(map(str, ms))}}} (shipped table" in lines[s.name], lines[s.name]
        else:
            assert "no table lists it" in lines[s.name] and f"moe-serve tune --model {path}" in lines[s.name]
    assert explain.main(["--model", str(path), "--device", "NO_SUCH_GPU", "--triton-version", SHIPPED_TRITON]) == 0
    other = capsys.readouterr().out
    assert other.count("no table lists it for NO_SUCH_GPU") == (len(shapes) if fp8_dense_gemv else 1)


def test_a_config_without_attention_sizes_says_the_dense_gemms_are_not_derived(tmp_path, capsys) -> None:
    assert explain.main(["--model", _model(tmp_path), "--device", "NVIDIA_H200"]) == 0
    assert "dense GEMMs (a decode step, per rank): not derived, config.json lacks 'num_attention_heads'" in capsys.readouterr().out
