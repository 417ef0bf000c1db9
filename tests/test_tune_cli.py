"""`moe-serve tune` end to end on the CPU (Triton's interpreter, wall-clock timing) on the
embedded model: tables and routing written where the server reads them, a second run skips
the tuned shape, a saved search state resumes, and clear exits without a GPU or a model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from moe_serve.kernels.moe import configs, routing
from moe_serve.kernels.tuning import tune
from moe_serve.loadtest.server_proc import start_server
from moe_serve.service.embedded_model import ensure_embedded_model
from tests.conftest import API_KEY

TUNE = [sys.executable, "-c", "import sys; from moe_serve.service.cli import main; sys.exit(main())", "tune"]


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(TUNE + args, env=e, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_embedded_model()


def test_no_gpu_and_bad_models_exit_2(model: Path, tmp_path: Path) -> None:
    r = _run(["--model", str(model)])
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr
    r = _run(["--model", str(tmp_path)], TRITON_INTERPRET="1")
    assert r.returncode == 2 and "no config.json" in r.stderr
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "hidden_size": 64}))
    r = _run(["--model", str(tmp_path)], TRITON_INTERPRET="1")
    assert r.returncode == 2 and "no MoE layers" in r.stderr


def test_tune_writes_tables_the_loader_reads_then_skips_and_resumes(model: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "cache"
    args = ["--model", str(model), "--budget-minutes", "0.4", "--buckets", "1,2,8", "--out", str(out), "--no-dense"]
    r = _run(args, TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stderr[-3000:]
    spec = json.loads((model / "config.json").read_text())
    E, N, K = spec["num_local_experts"], spec["intermediate_size"], spec["hidden_size"]
    table_path = out / configs.config_file_name(E, N, K, "bf16", "cpu")
    table = json.loads(table_path.read_text())
    assert {"1", "2", "8"} <= set(table) and table["search_s"] >= 0
    assert table["1"]["BLOCK_M"] >= 2                 # every config holds its bucket's slots
    routes = json.loads((out / routing.file_name("cpu")).read_text())["shapes"]
    ent = routes[routing.shape_key(E, N, K, "bf16")]
    assert ent["rule"].startswith("default rule") and ent["ranges"] == routing.default_ranges(E, N, K, 2)
    assert "tuned in" in r.stdout and "[tune] [" in r.stderr          # summary and progress
    # the loader (and so the server's workers) picks the tuned table up from that dir
    code = ("from moe_serve.kernels.moe import configs; import json, sys; "
            f"t = configs.load_table({E}, {N}, {K}, 'bf16', 'cpu'); "
            "print(json.dumps(sorted(t)))")
    env = {**os.environ, "MOE_SERVE_KERNEL_CONFIG_DIR": str(out)}
    loaded = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert json.loads(loaded.stdout) == [1, 2, 8], loaded.stderr[-2000:]
    # second run: the shape is tuned already
    again = _run(args, TRITON_INTERPRET="1")
    assert again.returncode == 0 and "already tuned" in again.stderr
    # resume: a saved state whose phases are all done is finished without timing anything
    table_path.unlink()
    part = out / ".partial" / table_path.name
    part.parent.mkdir(parents=True, exist_ok=True)
    done = ["starts", "D neighbours"] + [p[0] for p in tune.PHASES]
    part.write_text(json.dumps({"done": done, "best": {"decode": {"1": [1.0, table["1"]],
                                                                  "2": [1.0, table["2"]]},
                                                       "aligned": {"8": [1.0, table["8"]]}}}))
    resumed = _run(args, TRITON_INTERPRET="1")
    assert resumed.returncode == 0 and "resuming" in resumed.stderr
    assert json.loads(table_path.read_text())["1"] == table["1"] and not part.exists()
    # --refine: only the named phase, on the table in use; its record kept, the routing untouched
    routing_before = (out / routing.file_name("cpu")).read_text()
    bad = _run(["--model", str(model), "--refine", "no such phase", "--out", str(out)],
               TRITON_INTERPRET="1")
    assert bad.returncode == 2 and "decode prefetch" in bad.stderr       # names the phases
    ref = _run(["--model", str(model), "--refine", "decode prefetch", "--buckets", "1",
                "--out", str(out)], TRITON_INTERPRET="1")
    assert ref.returncode == 0 and "routing kept" in ref.stdout, ref.stderr[-3000:]
    refined = json.loads(table_path.read_text())
    assert refined["refined"]["phases"] == ["decode prefetch"]
    assert set(refined["refined"]["buckets"]) == {"1"} and refined["2"] == table["2"]
    assert (out / routing.file_name("cpu")).read_text() == routing_before
    nothing = _run(["--model", str(model), "--refine", "decode prefetch", "--out",
                    str(tmp_path / "empty")], TRITON_INTERPRET="1", MOE_SERVE_CACHE=str(tmp_path / "c"))
    assert nothing.returncode == 2 and "no table to refine" in nothing.stderr
    # a server started on that cache loads the table: the shape is reported tuned
    srv = start_server(tmp_path, api_key=API_KEY, env={"MOE_SERVE_KERNEL_CONFIG_DIR": str(out)})
    try:
        text = httpx.get(srv.base_url + "/metrics", headers=srv.headers, timeout=30).text
        assert 'moe_serve_moe_untuned_shapes 0.0' in text
        assert f'shape="E={E},N={N},K={K},topk=2,dtype=bf16",tuned="true"' in text
        assert "has no tuned kernel table" not in srv.log()
    finally:
        srv.stop()


def test_tune_also_searches_the_dense_gemms_into_the_same_place(model: Path, tmp_path: Path) -> None:
    """After the MoE shapes, the model's dense GEMMs (QKV, O, lm_head) are searched and their tables
    written beside the MoE ones, where the dense loader finds them; a second run skips the search."""
    from moe_serve.kernels.tuning.dense_shapes import dense_shapes
    from moe_serve.kernels.dense import configs as dense_configs

    spec = {**json.loads((model / "config.json").read_text()), "hidden_size": 64, "intermediate_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 96,
            "num_hidden_layers": 1}                                   # small enough for the interpreter
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(spec))
    out = tmp_path / "cache"
    args = ["--model", str(tiny), "--budget-minutes", "0.1", "--buckets", "1", "--dense-ms", "1", "--out", str(out)]
    r = _run(args, TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stderr[-3000:]
    shapes = {(s.N, s.K) for s in dense_shapes(spec, 1)}
    assert len(shapes) >= 2                                      # QKV and lm_head share 128 x 64 here
    assert {p.name for p in out.glob("dense,*")} == {dense_configs.table_file_name(N, K, "bf16", "cpu")
                                                       for N, K in shapes}
    assert (out / "dense-search" / "results.json").is_file() and "[tune] dense GEMMs: " in r.stdout
    N, K = sorted(shapes)[0]
    code = ("from moe_serve.kernels.dense import configs; import json; "
            f"print(json.dumps(sorted(configs.load_table({N}, {K}, 'bf16', 'cpu'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MOE_SERVE_KERNEL_CONFIG_DIR": str(out)})
    assert json.loads(loaded.stdout.strip().splitlines()[-1]) == [1], loaded.stderr[-2000:]
    again = _run(args, TRITON_INTERPRET="1")
    assert again.returncode == 0 and "dense GEMMs: already searched" in again.stderr


def test_untuned_shape_is_warned_and_counted(server, http) -> None:
    """The session server (embedded model, CPU): the warning says tuning needs a GPU, and names no
    command (`moe-serve tune` exits 2 without one)."""
    text = http.get("/metrics").text
    assert "moe_serve_moe_untuned_shapes 1.0" in text and "moe_serve_moe_refused_kernel_tables 0.0" in text
    assert 'tuned="false"' in text and 'moe_serve_moe_shape_info{' in text
    log = server.log()
    assert "has no tuned kernel table: tuning needs an NVIDIA GPU" in log
    assert "moe-serve tune --model" not in log and "Tune it on this GPU" not in log


def test_untuned_shape_on_a_gpu_names_the_tune_command(caplog) -> None:
    from moe_serve.kernels.tuning.model_shapes import MoEShape
    from moe_serve.service import kernel_tables

    status = kernel_tables.ShapeStatus(MoEShape("m/TP8", 8, 1792, 4096, 2, "bf16", 32), False, "1-4:ours,5+:vllm")
    kernel_tables.warn_untuned([status], "/models/mixtral", 8, None, "NVIDIA_H200")
    assert "for NVIDIA_H200" in caplog.text
    command = "moe-serve tune --model /models/mixtral --tensor-parallel-size 8"
    assert f"Tune it on this GPU (minutes): {command}" in caplog.text


def test_tuning_on_a_gpu_without_vllm_warns_that_the_search_is_unseeded(monkeypatch) -> None:
    from moe_serve.kernels.tuning import tune_cli
    from moe_serve.kernels.moe import vllm_kernels

    monkeypatch.setattr(vllm_kernels, "fused_experts", lambda: None)
    assert "vLLM is not importable" in tune_cli.seed_warning("cuda")
    assert tune_cli.seed_warning("cpu") is None                 # the interpreter pipeline
    monkeypatch.setattr(vllm_kernels, "fused_experts", lambda: (print, print))
    assert tune_cli.seed_warning("cuda") is None
