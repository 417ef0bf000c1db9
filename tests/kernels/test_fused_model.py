"""The fused model classes (kernels/models/) in vLLM's real CPU engine: a tiny fp32 Qwen3-MoE and a
tiny Mixtral with dummy weights, each served in this process by vllm.LLM with our classes
registered (kernels/models/registry.py) and the switches on, the fused ops running our Triton
kernels under the interpreter (moe_serve.kernels.fused.ops.CPU_INTERPRETER). The same prompts' greedy
tokens, their log-probabilities and the prompt's log-probabilities (top 5 at each position) come
out the same with the pieces fused (our kernels), with Qwen3's norm + QKV piece alone (the op's
CPU path: vLLM's semantics in torch), and with vLLM's own layer classes swapped back in.

What this proves: the plumbing. vLLM's registry builds our classes, the switches reach every
layer, the ops get the right weights, epsilon, heads, rotary cache and style, the first layer's
missing residual and each layer's residual chain, and a layer's output is vLLM's layer's. The
kernels' own numerics are the interpreter tests' job (test_fused_norm_gemv.py,
test_fused_qk_norm_rope.py); here they run at the engine's M (5 at prefill, 2 at decode).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.engine

COMMON = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 256,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2,
          "tie_word_embeddings": False, "torch_dtype": "float32", "sliding_window": None, "num_experts_per_tok": 2}
MODELS = {  # name: (config.json, the fused pieces its layers run)
    "qwen3-moe": ({**COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                   "moe_intermediate_size": 16, "num_experts": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": False},
                  {"fuse_norm_gemv": 2, "fuse_qk_norm_rope": 2}),
    "mixtral": ({**COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4},
                {"fuse_norm_gemv": 2}),
}
QKV_ROWS = (2 + 2 * 1) * 32                  # both models' QKV GEMV: [128, 32]
PROMPTS = [[1, 17, 201], [1, 90]]            # token ids: 5 prefill tokens in all, then decode at M = 2
STEPS = 2 * 3                                # 2 layers x (one prefill step, 2 decode steps)


def _restore_vllm_classes() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _VLLM_MODELS

    from moe_serve.kernels.models.registry import MODEL_CLASSES

    for arch in MODEL_CLASSES:
        module, cls = _VLLM_MODELS[arch]
        ModelRegistry.register_model(arch, f"vllm.model_executor.models.{module}:{cls}")


@pytest.fixture(scope="module", params=list(MODELS))
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    import triton
    from vllm import LLM

    from moe_serve.kernels import config as plugin_config
    from moe_serve.kernels.dense import configs as dense_configs
    from moe_serve.kernels.fused import ops
    from moe_serve.kernels.models.registry import MODEL_CLASSES, register_model_classes

    name = request.param
    tmp = tmp_path_factory.mktemp(f"fused-{name}")
    model = tmp / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODELS[name][0]))
    tables = tmp / "tables"               # the QKV GEMV's tables: 32 rows a program (few interpreted programs)
    tables.mkdir()
    cfg = {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 1, "ACC_PAIRS": False, "PREFETCH": True}
    for kind in dense_configs.KINDS:      # the GEMV's and the fused norm + GEMV's (every bucket: fused at each M)
        (tables / dense_configs.table_file_name(QKV_ROWS, COMMON["hidden_size"], "fp32", "cpu", kind)).write_text(
            dense_configs.table_json({b: cfg for b in dense_configs.BUCKETS}, triton.__version__))
    dense_configs.load_table.cache_clear()
    dense_configs.config_for.cache_clear()
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")         # the engine core in this process
    mp.setattr(ops, "CPU_INTERPRETER", True)
    config = plugin_config.PluginConfig(fuse_norm_gemv=True, fuse_qk_norm_rope=True, kernel_config_dir=str(tables))
    plugin_config.configure(config)
    assert register_model_classes(fused=True) == list(MODEL_CLASSES)
    engine = LLM(model=str(model), dtype="float32", load_format="dummy", enforce_eager=True,
                 skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64,
                 kv_cache_memory_bytes=64 << 20, seed=0)
    try:
        yield name, engine
    finally:
        plugin_config.configure(None)
        dense_configs.load_table.cache_clear()
        dense_configs.config_for.cache_clear()
        _restore_vllm_classes()
        del engine
        mp.undo()


def _run(llm: Any) -> list[tuple[list[int], list[float], list[dict[int, float]]]]:
    """Per prompt: (the 3 greedy tokens, their log-probabilities, the prompt's top-5 maps)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5, prompt_logprobs=5, detokenize=False,
                            ignore_eos=True)
    out = []
    for r in llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False):
        c = r.outputs[0]
        out.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                    [{t: v.logprob for t, v in lp.items()} for lp in r.prompt_logprobs[1:]]))
    return out


def _same(a: list, b: list) -> None:
    for (toks_a, lps_a, prompt_a), (toks_b, lps_b, prompt_b) in zip(a, b, strict=True):
        assert toks_a == toks_b
        assert all(math.isclose(x, y, abs_tol=2e-4) for x, y in zip(lps_a, lps_b, strict=True)), (lps_a, lps_b)
        for pa, pb in zip(prompt_a, prompt_b, strict=True):
            shared = pa.keys() & pb.keys()
            assert len(shared) >= 4 and all(math.isclose(pa[t], pb[t], abs_tol=2e-4) for t in shared), (pa, pb)


def _set(model: Any, qk: bool | None = None, vllm_classes: bool = False) -> dict[str, int]:
    """The model's fused-piece counts; then its layers' Q/K flag set to qk, or vLLM's classes back."""
    counts = model.fused_layers()
    for layer in model.model.layers:
        if vllm_classes:            # the fused classes' direct bases: vLLM's decoder layer and attention
            layer.__class__, layer.self_attn.__class__ = type(layer).__bases__[0], type(layer.self_attn).__bases__[0]
        elif qk is not None:
            layer.self_attn.fuse_qk_norm_rope = qk
    return counts


def test_logprobs_with_the_switches_on_and_off_match_vllms_layers(llm: tuple[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_serve.kernels.fused import norm_gemv, ops, qk_norm_rope, reference

    name, engine = llm
    calls: dict[str, int] = {}

    def counted(module: Any, attr: str) -> None:
        fn = getattr(module, attr)

        def run(*args: Any, **kwargs: Any) -> Any:
            calls[attr] = calls.get(attr, 0) + 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, attr, run)

    for module, attr in ((norm_gemv, "norm_gemv"), (qk_norm_rope, "qk_norm_rope"), (reference, "norm_linear"),
                         (reference, "qk_norm_rope")):
        counted(module, attr)
    pieces = MODELS[name][1]
    assert engine.apply_model(_set) == [pieces]
    if name == "mixtral":                         # fused_router (on): each block's gate moved into its runner
        assert engine.apply_model(lambda m: [type(layer.block_sparse_moe).__name__ == "GatedMixtralMoE"
                                             and layer.block_sparse_moe.experts.gate is layer.block_sparse_moe.gate
                                             for layer in m.model.layers]) == [[True, True]]
    fused = _run(engine)
    want = {"norm_gemv": STEPS, **({"qk_norm_rope": STEPS} if "fuse_qk_norm_rope" in pieces else {})}
    assert calls == want, calls
    if "fuse_qk_norm_rope" in pieces:            # the norm + QKV piece alone, on the ops' CPU path
        monkeypatch.setattr(ops, "CPU_INTERPRETER", False)
        engine.apply_model(lambda m: _set(m, qk=False))
        _same(_run(engine), fused)
        want["norm_linear"] = STEPS
        assert calls == want, calls
    engine.apply_model(lambda m: _set(m, vllm_classes=True))
    _same(fused, _run(engine))
    assert calls == want, calls
