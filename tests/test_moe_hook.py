"""The MoE hook's decisions and argument mapping, and register() per mode. Patching vLLM runs
in subprocesses (clean vLLM classes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_serve.kernels.plugin import vllm_compat
from moe_serve.kernels.plugin.moe_hook import unsupported_reason

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, **env: str) -> dict:
    full = {**os.environ, **env}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


_REGISTER = """
    import json, inspect, logging
    from types import SimpleNamespace
    logging.basicConfig(level=logging.DEBUG, format="LOG %(levelname)s %(message)s")
    from moe_serve.kernels.plugin import vllm_pins, vllm_plugin as vp
    if {fail_pin}:
        vllm_pins.PINS = (*vllm_pins.PINS, lambda: (_ for _ in ()).throw(AssertionError("moved")))
    vp.register(); vp.register()  # idempotent
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.v1.worker.worker_base import WorkerBase
    p = vp.PLUGIN
    before = getattr(TritonExperts.apply, "__moe_serve__", False)
    if p is not None and {worker}:      # a worker's init: its config, then the kernel hooks it asks for
        class Worker:
            compile_or_warm_up_model = lambda self: None
        worker = Worker()
        worker.vllm_config = SimpleNamespace(additional_config={additional})
        p.on_worker_init(worker)
    print(json.dumps({{"hooks": p.hooks if p else None, "mode": p.mode if p else None,
                      "pins_failed": list(p.pins_failed) if p else None, "before_worker": before,
                      "wrapped": getattr(TritonExperts.apply, "__moe_serve__", False),
                      "init": getattr(WorkerBase.__init__, "__moe_serve__", False),
                      "params": list(inspect.signature(TritonExperts.apply).parameters)}}))
"""


def _register(fail_pin: bool = False, worker: bool = True, additional: dict | None = None,
              **env: str) -> tuple[dict, str]:
    """register() twice in a fresh process, then one worker init with `additional` as its
    vllm_config.additional_config: (what it installed, its log lines)."""
    full = {**os.environ, "TRITON_INTERPRET": "0", **env}
    full.pop("MOE_SERVE_VLLM_PINS_WARNED", None)
    code = _REGISTER.format(fail_pin=fail_pin, worker=worker, additional=repr(additional or {}))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.mark.parametrize("mode,wrapped", [("optimized", True), ("vllm", False)])
def test_register_per_mode(mode: str, wrapped: bool) -> None:
    """register() hooks the worker's init only; the worker's config (its additional_config over
    the environment) then decides the kernel hooks."""
    out, _ = _register(additional={"moe_serve": {"mode": mode}}, MOE_SERVE_VLLM_PLUGIN="1",
                       MOE_SERVE_MOE_KERNELS="vllm" if mode == "optimized" else "optimized")
    assert out["mode"] == mode and out["init"] is True and out["pins_failed"] == []
    assert out["before_worker"] is False
    assert out["wrapped"] is wrapped and ("TritonExperts.apply" in out["hooks"]) is wrapped
    assert out["params"] == list(vllm_compat.APPLY_PARAMS)
    assert out["hooks"].count("WorkerBase.__init__") == 1
    from moe_serve.kernels.plugin.vllm_pins import PATCHES

    supported = {h for h in out["hooks"] if h.startswith("ModelRegistry[")}     # vLLM's own extension point
    assert set(out["hooks"]) - {"triton.knobs.runtime.jit_post_compile_hook"} - supported <= set(PATCHES), out["hooks"]
    assert ("ModelRegistry[MixtralForCausalLM]" in out["hooks"]) is wrapped    # our router: Mixtral's gate moves


def test_a_bad_setting_stops_the_process_at_register_or_at_worker_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad MOE_SERVE_* value raises in register() (vllm serve stops as it starts) before anything
    is patched; a bad additional_config value raises out of the worker's __init__ (the worker does
    not start), before any kernel hook is installed."""
    from moe_serve.kernels.config import PluginConfig, PluginConfigError
    from moe_serve.kernels.plugin import vllm_plugin as vp

    monkeypatch.setenv(vp.ENABLE_ENV, "1")
    monkeypatch.setenv("MOE_SERVE_BLOCK_PDL", "2")
    monkeypatch.setattr(vp, "PLUGIN", None)
    with pytest.raises(PluginConfigError, match="MOE_SERVE_BLOCK_PDL"):
        vp.register()
    assert vp.PLUGIN is None
    monkeypatch.delenv("MOE_SERVE_BLOCK_PDL")
    plugin = vp.MoePlugin(PluginConfig(), None)

    class Worker:
        def __init__(self, extra: dict) -> None:
            self.vllm_config = SimpleNamespace(additional_config=extra)

    assert vllm_compat.wrap_method(Worker, "__init__", plugin.around_worker_init)
    with pytest.raises(PluginConfigError, match=r"additional_config\['moe_serve'\]\['moe_routing'\]"):
        Worker({"moe_serve": {"moe_routing": "sometimes"}})
    assert plugin.hooks == [] and not plugin.kernel_hooks_installed


def test_register_is_inert_in_a_vllm_process_moe_serve_did_not_start() -> None:
    """Installed beside vLLM, the plugin patches nothing unless MOE_SERVE_VLLM_PLUGIN=1: one debug line."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_SERVE_VLLM_PLUGIN"}
    for value in (None, "0"):
        out, log = _register(**{**env, **({"MOE_SERVE_VLLM_PLUGIN": value} if value else {})})
        assert out["hooks"] is None and not out["wrapped"] and not out["init"], out
        lines = [line for line in log.splitlines() if line.startswith("LOG") and "moe-serve plugin" in line]
        assert len(lines) == 1 and lines[0].startswith("LOG DEBUG moe-serve plugin inert"), lines


def test_a_failing_pin_leaves_vllm_kernels_serving_with_one_warning() -> None:
    out, log = _register(fail_pin=True, additional={"moe_serve": {"mode": "optimized"}}, MOE_SERVE_VLLM_PLUGIN="1")
    assert out["mode"] == "vllm" and out["pins_failed"] == ["<lambda>"]
    assert not out["wrapped"] and not any("Router" in h or "Runner" in h for h in out["hooks"]), out["hooks"]
    warnings = [line for line in log.splitlines() if line.startswith("LOG WARNING") and "moe-serve" in line]
    assert len(warnings) == 1 and "internals do not match moe-serve's pins" in warnings[0], warnings
    assert "<lambda>: AssertionError('moved')" in warnings[0]


class _Experts(SimpleNamespace):
    """An experts object as the hook reads vLLM's: block_shape / per_act_token_quant are
    FusedMoEExperts properties over its quant_config (pinned by vllm_pins.pin_fp8_layout)."""

    block_shape = property(lambda self: self.quant_config.block_shape)
    per_act_token_quant = property(lambda self: self.quant_config.per_act_token_quant)


def _experts(**quant) -> SimpleNamespace:
    q = SimpleNamespace(**{"use_fp8_w8a8": False, "quant_dtype": None, "block_shape": None,
                           "per_act_token_quant": False, "gemm1_clamp_limit": None,
                           "gemm1_alpha": None, "gemm1_beta": None, **quant})
    return _Experts(quant_config=q, _lora_context=None, w1_bias=None, w2_bias=None,
                    quantization_emulation=False, w1_scale=None, w2_scale=None, a1_scale=None,
                    a2_scale=None)


SILU = SimpleNamespace(name="SILU")
E, N, K, M, TOPK = 4, 16, 32, 5, 2


def _why(experts=None, act=SILU, expert_map=None, gne=-1, dtype=torch.float32, w_dtype=None,
         out_dtype=None, a1q_scale=None, require_cuda=False, n_w1=2 * N, a2_scale=None) -> str | None:
    base = vllm_compat.load(vllm_compat.EXPERTS)
    call = vllm_compat.ApplyCall(
        torch.zeros(M, K, dtype=out_dtype or dtype), torch.zeros(M, K, dtype=dtype),
        torch.zeros(E, n_w1, K, dtype=w_dtype or dtype), torch.zeros(E, K, N, dtype=w_dtype or dtype),
        torch.ones(M, TOPK), torch.zeros(M, TOPK, dtype=torch.int32), act, gne, expert_map, a1q_scale,
        a2_scale, torch.zeros(1), torch.zeros(1), None, False)
    return unsupported_reason(experts or _experts(), call, require_cuda=require_cuda, experts_base=base)


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
    # per-token dynamic activations (FP8-dynamic): [M, 1] scales with the format flag
    f.w1_scale = torch.ones(E, 2 * N)
    f.quant_config.per_act_token_quant = True
    assert _why(f, a1q_scale=torch.ones(M, 1), **kw) is None
    assert _why(f, a1q_scale=torch.ones(1), **kw) == "fp8_act_scale_per_token_layout"
    assert _why(f, a1q_scale=torch.ones(M, 1), a2_scale=torch.ones(1), **kw) == "fp8_a2_scale_layout"
    # block FP8: [E, cdiv(rows, bn), cdiv(cols, bk)] weight scales, [M, cdiv(K, bk)] act scales
    b = _experts(use_fp8_w8a8=True, block_shape=[16, 16])
    b.w1_scale, b.w2_scale = torch.ones(E, 2 * N // 16, K // 16), torch.ones(E, K // 16, N // 16)
    assert _why(b, a1q_scale=torch.ones(M, K // 16), **kw) is None
    assert _why(b, a1q_scale=torch.ones(M, 1), **kw) == "fp8_block_act_scale_layout"
    assert _why(b, a1q_scale=torch.ones(M, K // 16), a2_scale=torch.ones(1), **kw) == "fp8_a2_scale_layout"
    b.quant_config.block_shape = [16, 24]                  # bk is the K loop's tile: a power of two
    assert _why(b, a1q_scale=torch.ones(M, 2), **kw) == "fp8_block_shape:16x24"
    b.quant_config.block_shape = [32, 16]
    assert _why(b, a1q_scale=torch.ones(M, K // 16), **kw) == "fp8_block_scale_layout"


def test_wrapper_calls_vllm_with_every_argument() -> None:
    """The installed wrapper (vllm_compat.apply_wrapper) takes apply's arguments by keyword or
    position and hands vLLM's original every one of them, by keyword, unchanged."""
    seen = {}

    def orig(self, **kwargs):
        seen.update(kwargs, self=self)
        return "vllm-result"

    apply = vllm_compat.apply_wrapper(lambda o, experts, call: vllm_compat.call_apply(o, experts, call))(orig)
    names = vllm_compat.APPLY_PARAMS[1:]
    args = {name: object() for name in names}
    ex = object()
    assert apply(ex, **args) == "vllm-result"
    assert seen.pop("self") is ex and all(seen[k] is v for k, v in args.items()) and set(seen) == set(names)
    seen.clear()
    assert apply(ex, *args.values()) == "vllm-result" and all(seen[k] is v for k, v in args.items())


def test_a_call_whose_gemm2_finishes_elsewhere_stays_vllms() -> None:
    """vLLM 0.33 lets a model finish GEMM2's rows its own way (a post_gemm2_hook, a TritonExperts
    subclass overriding the finish) and reads UVA-offloaded weights in place: vLLM's kernel serves."""
    base = vllm_compat.load(vllm_compat.EXPERTS)

    def experts(cls: type = base, **attrs: object) -> object:
        ex = object.__new__(cls)  # no vLLM config needed: the hook reads attributes only
        ex.quant_config = _experts().quant_config
        for name, value in attrs.items():
            setattr(ex, name, value)
        return ex

    class OwnReduce(base):
        def finalize_weight_and_reduce_impl(self):  # noqa: ANN202 - a stand-in override
            return None

    assert _why(experts()) is None
    assert _why(experts(post_gemm2_hook=lambda rows, out: None)) == "post_gemm2_hook"
    assert _why(experts(OwnReduce)) == "custom_finish:finalize_weight_and_reduce_impl"
    call = vllm_compat.ApplyCall(*[None] * 15)
    call.w1, call.w2 = torch.zeros(1), torch.zeros(1)
    setattr(call.w2, vllm_compat.UVA_MARK, True)
    assert vllm_compat.custom_finish(experts(), call, base) == "host_resident_weights"


def test_our_path_maps_arguments_correctly() -> None:
    """run_ours (what the hook calls for supported cases) writes vLLM's `output` buffer with
    the MoE result, for 16/32-bit, FP8 per-tensor static, block FP8 and per-token FP8 inputs
    (interpreter, CPU), and names each layer's format for routing."""
    out = _run("""
        import json, torch
        from types import SimpleNamespace
        from moe_serve.bench.experts.reference import moe_reference, rel_err, routing
        from moe_serve.kernels.plugin.moe_hook import MoeHook, fp8_scales, layer_shape
        from moe_serve.kernels.plugin.vllm_compat import ApplyCall
        E, N, K, M, TOPK = 4, 16, 32, 7, 2
        g = torch.Generator().manual_seed(0)
        res = {}
        hook = MoeHook(None, None)
        q = SimpleNamespace(use_fp8_w8a8=False, quant_dtype=None, block_shape=None,
                            per_act_token_quant=False)
        def call(x, w1, w2, tw, ids, out, a1=None, a2=None):
            return ApplyCall(out, x, w1, w2, tw, ids, "silu", E, None, a1, a2, None, None, None, False)
        for dt in (torch.float32, torch.float16):
            x = torch.randn(M, K, generator=g).to(dt)
            w1 = (torch.randn(E, 2 * N, K, generator=g) * 0.2).to(dt)
            w2 = (torch.randn(E, K, N, generator=g) * 0.2).to(dt)
            tw, ids = routing(M, E, TOPK, g)
            out = torch.full((M, K), float("nan"), dtype=dt)
            c = call(x, w1, w2, tw, ids, out)
            hook.run_ours(SimpleNamespace(quant_config=q), c, fp8_scales(None, c), None)
            res[str(dt)] = rel_err(out, moe_reference(x, w1, w2, tw, ids))
        fp8 = torch.float8_e4m3fn
        x = torch.randn(M, K, generator=g).to(fp8)
        w1 = (torch.randn(E, 2 * N, K, generator=g)).to(fp8)
        w2 = (torch.randn(E, K, N, generator=g)).to(fp8)
        s1, s2, a1, a2 = torch.full((E,), 0.05), torch.full((E,), 0.05), torch.tensor(0.5), torch.tensor(0.05)
        tw, ids = routing(M, E, TOPK, g)
        ex = SimpleNamespace(quant_config=q, w1_scale=s1, w2_scale=s2, a1_scale=None, block_shape=None,
                             per_act_token_quant=False)
        out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
        c = call(x, w1, w2, tw, ids, out, a1, a2)
        hook.run_ours(ex, c, fp8_scales(ex, c), None)
        ref = moe_reference(x, w1, w2, tw, ids, w1_scale=s1, w2_scale=s2, a1_scale=a1, quant_acts="static",
                            a2_scale=a2)
        res["fp8"] = rel_err(out.float(), ref)
        # block FP8 and per-token FP8 as vLLM's prepare step hands them over (fp8 x + scales)
        from moe_serve.bench.experts.reference import quant_fp8_block, quant_act_groups, quant_fp8
        x = torch.randn(M, K, generator=g)
        for name, block, per_tok in (("block", [16, 16], False), ("per_token", None, True)):
            qb = SimpleNamespace(use_fp8_w8a8=True, quant_dtype=fp8, block_shape=block,
                                 per_act_token_quant=per_tok)
            w1 = torch.randn(E, 2 * N, K, generator=g) / K ** 0.5
            w2 = torch.randn(E, K, N, generator=g) / N ** 0.5
            if block:
                (q1, s1), (q2, s2) = quant_fp8_block(w1, 16, 16), quant_fp8_block(w2, 16, 16)
                xq, a1 = quant_act_groups(x, 16)
            else:
                (q1, s1), (q2, s2) = quant_fp8(w1, True), quant_fp8(w2, True)
                a1 = x.abs().amax(1, keepdim=True) / 448.0
                xq = (x / a1).to(fp8)
            ex = SimpleNamespace(quant_config=qb, block_shape=block, per_act_token_quant=per_tok,
                                 w1_scale=s1, w2_scale=s2, a1_scale=None)
            out = torch.full((M, K), float("nan"), dtype=torch.bfloat16)
            c = call(xq, q1, q2, tw, ids, out, a1, None)
            hook.run_ours(ex, c, fp8_scales(ex, c), None)
            ref = moe_reference(xq, q1, q2, tw, ids, w1_scale=s1, w2_scale=s2, a1_scale=a1,
                                block_shape=tuple(block) if block else None)
            res[name] = rel_err(out.float(), ref)
            shape = layer_shape(c, fp8_scales(ex, c))
            res[name + "_key"] = shape.route_dtype
        print(json.dumps(res))
    """, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    assert out["torch.float32"] < 1e-3 and out["torch.float16"] < 1e-2, out
    assert out["fp8"] < 5e-2, out
    assert out["block"] < 0.12 and out["per_token"] < 0.12, out
    assert out["block_key"] == "fp8_w8a8,block_shape=[16,16]", out
    assert out["per_token_key"] == "fp8_w8a8,per_token", out


def test_the_hook_looks_its_layers_plan_up_and_fails_closed() -> None:
    """The hook builds a layer's plan at its first supported call (once per layer) and follows it:
    under VLLM_BATCH_INVARIANT every call is vLLM's, counted as a fallback with the plan's reason;
    else the plan's route and config for M."""
    from moe_serve.kernels.config import PluginConfig
    from moe_serve.kernels.plugin import layer_plan
    from moe_serve.kernels.plugin.layer_warmup import LayerWarmup
    from moe_serve.kernels.plugin.moe_hook import MoeHook

    def served(batch_invariant: bool) -> tuple[list, list, list]:
        ctx = layer_plan.PlanContext(PluginConfig(moe_routing="ours"), "cpu", None, "test", batch_invariant)
        built, counted, ours = [], [], []
        plugin = SimpleNamespace(
            phase="warmup", logger=None, count_fallback=counted.append, count_launch=counted.append,
            plan_for=lambda facts, w1: built.append(facts) or layer_plan.build(facts, ctx))
        hook = MoeHook(plugin, LayerWarmup(plugin))
        hook.require_cuda = False
        hook.run_ours = lambda experts, call, scales, config: ours.append(config["BLOCK_M"])
        experts = _experts()
        for M in (1, 2, 1):
            call = vllm_compat.ApplyCall(
                torch.zeros(M, K), torch.zeros(M, K), torch.zeros(E, 2 * N, K), torch.zeros(E, K, N), torch.ones(M, TOPK),
                torch.zeros(M, TOPK, dtype=torch.int32), SILU, -1, None, None, None, torch.zeros(1), torch.zeros(1),
                None, False)
            hook.handle(lambda self, **kw: counted.append("vllm"), experts, call)
        return built, counted, ours

    built, counted, ours = served(batch_invariant=True)
    assert len(built) == 1 and ours == [] and counted == ["batch_invariant", "vllm"] * 3
    built, counted, ours = served(batch_invariant=False)
    assert len(built) == 1 and counted == ["optimized"] * 3 and len(ours) == 3
