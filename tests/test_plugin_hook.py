"""The plugin's hook points in vLLM (pinned), the TritonExperts.apply wrapper's decisions and
argument mapping, and register() per mode. Patching runs in subprocesses (clean vLLM classes)."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels import plugin_moe_hook as hook
from kernels import vllm_plugin as vp
from kernels.plugin_state import report

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, **env: str) -> dict:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(inspect.unwrap(fn)).parameters)


def test_hook_target_is_pinned() -> None:
    """Fails loudly when vLLM moves/renames TritonExperts.apply or changes its parameters."""
    import importlib

    mod = importlib.import_module(hook.EXPERTS_MODULE)
    cls = getattr(mod, hook.EXPERTS_CLASS)
    assert _params(cls.apply) == hook.APPLY_PARAMS
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    assert _params(mk.FusedMoEExpertsModular.apply) == hook.APPLY_PARAMS
    assert cls.finalize_weight_and_reduce_impl.__qualname__.startswith("TritonExperts")  # output = final sum
    base = getattr(importlib.import_module(vp.WORKER_BASE[0]), vp.WORKER_BASE[1])
    assert {"rank", "local_rank", "vllm_config"} <= set(inspect.signature(inspect.unwrap(base.__init__)).parameters)
    assert callable(getattr(base, vp.WARMUP_METHOD))
    from vllm.v1.worker.gpu_worker import Worker

    assert _params(getattr(Worker, vp.WARMUP_METHOD)) == ("self",)


def test_vllm_warmup_dependencies_are_pinned() -> None:
    """The vLLM warm-up groups M by vLLM's own config choice and sizes flat workspaces that
    TritonExperts.apply views with _resize_cache (first prod(shape) elements)."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    assert _params(fm.try_get_optimal_moe_config)[:5] == ("w1_shape", "w2_shape", "top_k",
                                                          "dtype", "M")
    cfg = fm.try_get_optimal_moe_config((8, 64, 32), (8, 32, 32), 2, None, 5)
    assert "BLOCK_SIZE_M" in cfg
    from vllm.model_executor.layers.fused_moe.utils import _resize_cache

    flat = torch.zeros(100)
    assert _resize_cache(flat, (3, 4)).shape == (3, 4)


@pytest.mark.parametrize("mode,wrapped", [("optimized", True), ("vllm", False)])
def test_register_per_mode(mode: str, wrapped: bool) -> None:
    out = _run("""
        import json, inspect
        from kernels import vllm_plugin as vp, plugin_state
        vp.register(); vp.register()  # idempotent
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
        from vllm.v1.worker.worker_base import WorkerBase
        print(json.dumps({"hooks": plugin_state.hooks, "wrapped": getattr(TritonExperts.apply, "__moe_serve__", False),
                          "init": getattr(WorkerBase.__init__, "__moe_serve__", False),
                          "params": list(inspect.signature(TritonExperts.apply).parameters),
                          "errors": plugin_state.report().data.get("hook_errors"), "mode": plugin_state.report().data["mode"]}))
    """, MOE_SERVE_MOE_KERNELS=mode, TRITON_INTERPRET="0")
    assert out["errors"] is None and out["mode"] == mode and out["init"] is True
    assert out["wrapped"] is wrapped and ("TritonExperts.apply" in out["hooks"]) is wrapped
    assert out["params"] == list(hook.APPLY_PARAMS)
    assert out["hooks"].count("WorkerBase.__init__") == 1


def _experts(**quant) -> SimpleNamespace:
    q = SimpleNamespace(**{"use_fp8_w8a8": False, "quant_dtype": None, "block_shape": None,
                           "gemm1_clamp_limit": None, "gemm1_alpha": None, "gemm1_beta": None, **quant})
    return SimpleNamespace(quant_config=q, _lora_context=None, w1_bias=None, w2_bias=None,
                           quantization_emulation=False, w1_scale=None, w2_scale=None, a1_scale=None,
                           a2_scale=None)


SILU = SimpleNamespace(name="SILU")
E, N, K, M, TOPK = 4, 16, 32, 5, 2


def _why(experts=None, act=SILU, expert_map=None, gne=-1, dtype=torch.float32, w_dtype=None,
         out_dtype=None, a1q_scale=None, require_cuda=False, n_w1=2 * N) -> str | None:
    x = torch.zeros(M, K, dtype=dtype)
    w1 = torch.zeros(E, n_w1, K, dtype=w_dtype or dtype)
    w2 = torch.zeros(E, K, N, dtype=w_dtype or dtype)
    out = torch.zeros(M, K, dtype=out_dtype or dtype)
    return hook.unsupported_reason(experts or _experts(), out, x, w1, w2, act, gne, expert_map, a1q_scale,
                                 require_cuda=require_cuda)


def test_unsupported_reasons() -> None:
    fp8 = torch.float8_e4m3fn
    assert _why() is None
    assert _why(dtype=torch.float16) is None
    assert _why(require_cuda=True) == "device"
    assert _why(act=SimpleNamespace(name="GELU")) == "activation:GELU"
    assert _why(expert_map=torch.zeros(E)) == "expert_map"
    lora = _experts()
    lora._lora_context = object()
    assert _why(lora) == "lora"
    bias = _experts()
    bias.w1_bias = torch.zeros(1)
    assert _why(bias) == "bias"
    assert _why(_experts(), gne=2 * E) == "global_num_experts"
    assert _why(n_w1=N) == "not_gated"
    assert _why(out_dtype=torch.float16) == "mixed_dtypes"
    assert _why(_experts(quant_dtype=torch.int8)) == f"quant:{torch.int8}"
    ex = _experts()
    ex.quant_config.gemm1_clamp_limit = 7.0
    assert _why(ex) == "swiglu_params"
    # FP8 W8A8
    f = _experts()
    f.quant_config.use_fp8_w8a8 = True
    f.w1_scale, f.w2_scale = torch.ones(E), torch.ones(E)
    kw = dict(dtype=fp8, w_dtype=fp8, out_dtype=torch.bfloat16)
    assert _why(f, a1q_scale=torch.ones(1), **kw) is None
    assert _why(f, a1q_scale=torch.ones(M, 1), **kw) == "fp8_act_scale_per_token"
    assert _why(f, a1q_scale=torch.ones(1), dtype=fp8, w_dtype=fp8, out_dtype=torch.float16) == "fp8_dtypes"
    f.w1_scale = torch.ones(E, 2 * N)  # per-channel
    assert _why(f, a1q_scale=torch.ones(1), **kw) is None
    f.w1_scale = torch.ones(E, 3)
    assert _why(f, a1q_scale=torch.ones(1), **kw) == "fp8_w_scale_layout"
    f.w1_scale = torch.ones(E)
    f.quant_config.block_shape = [128, 128]
    assert _why(f, a1q_scale=torch.ones(1), **kw) == "fp8_block"


def test_fallback_calls_vllm_with_every_argument() -> None:
    """A case we do not take (CPU tensors) reaches vLLM's original with all its arguments."""
    seen = {}

    def orig(self, **kwargs):
        seen.update(kwargs, self=self)
        return "vllm-result"

    apply = hook.make_apply(orig)
    ex = _experts()
    args = dict(output=torch.zeros(M, K), hidden_states=torch.zeros(M, K), w1=torch.zeros(E, 2 * N, K),
                w2=torch.zeros(E, K, N), topk_weights=torch.ones(M, TOPK), topk_ids=torch.zeros(M, TOPK, dtype=torch.int32),
                activation=SILU, global_num_experts=E, expert_map=None, a1q_scale=None, a2_scale=None,
                workspace13=torch.zeros(1), workspace2=torch.zeros(1), expert_tokens_meta=None,
                apply_router_weight_on_input=False)
    before = dict(report().data["fallback_reasons"])
    assert apply(ex, **args) == "vllm-result"
    assert seen.pop("self") is ex and set(seen) == set(hook.APPLY_PARAMS) - {"self"}
    assert all(seen[k] is v for k, v in args.items())
    assert report().data["fallback_reasons"].get("device", 0) == before.get("device", 0) + 1


def test_our_path_maps_arguments_correctly() -> None:
    """_run_ours (what the wrapper calls for supported cases) writes vLLM's `output` buffer with
    the MoE result, for 16/32-bit and FP8 per-tensor static inputs (interpreter, CPU)."""
    out = _run("""
        import json, torch
        from types import SimpleNamespace
        from tests.kernels.reference import moe_reference, rel_err, routing
        from kernels import plugin_moe_hook as hook, plugin_state
        E, N, K, M, TOPK = 4, 16, 32, 7, 2
        g = torch.Generator().manual_seed(0)
        res = {}
        q = SimpleNamespace(use_fp8_w8a8=False, quant_dtype=None, block_shape=None)
        for dt in (torch.float32, torch.float16):
            x = torch.randn(M, K, generator=g).to(dt)
            w1 = (torch.randn(E, 2 * N, K, generator=g) * 0.2).to(dt)
            w2 = (torch.randn(E, K, N, generator=g) * 0.2).to(dt)
            tw, ids = routing(M, E, TOPK, g)
            out = torch.full((M, K), float("nan"), dtype=dt)
            hook._run_ours(SimpleNamespace(quant_config=q), out, x, w1, w2, tw, ids, None, None, False)
            res[str(dt)] = rel_err(out, moe_reference(x, w1, w2, tw, ids))
        fp8 = torch.float8_e4m3fn
        x = torch.randn(M, K, generator=g).to(fp8)
        w1 = (torch.randn(E, 2 * N, K, generator=g)).to(fp8)
        w2 = (torch.randn(E, K, N, generator=g)).to(fp8)
        s1, s2, a1, a2 = torch.full((E,), 0.05), torch.full((E,), 0.05), torch.tensor(0.5), torch.tensor(0.05)
        tw, ids = routing(M, E, TOPK, g)
        ex = SimpleNamespace(quant_config=q, w1_scale=s1, w2_scale=s2, a1_scale=None)
        out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
        hook._run_ours(ex, out, x, w1, w2, tw, ids, a1, a2, False)
        ref = moe_reference(x, w1, w2, tw, ids, w1_scale=s1, w2_scale=s2, a1_scale=a1, quant_acts="static", a2_scale=a2)
        res["fp8"] = rel_err(out.float(), ref)
        res["calls"] = plugin_state.report().data["moe_calls"].get("optimized")
        print(json.dumps(res))
    """, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    assert out["calls"] == 3
    assert out["torch.float32"] < 1e-3 and out["torch.float16"] < 1e-2, out
    assert out["fp8"] < 5e-2, out
