"""The yardstick's parts without a server (bench/serve): byte floor, run order, server commands,
statistics, kernel classes, answers, engine configurations, rendering, and the run's refusals
(budget, another workload, another engine configuration)."""
from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from moe_serve.bench.serve import answers, roofline, servers
from moe_serve.bench.serve import render as serve_render
from moe_serve.bench.serve import schedule
from moe_serve.bench.serve import stats as serve_stats
from moe_serve.bench.serve import trace
from moe_serve.bench.serve import yardstick as serve_ab
from moe_serve.bench.serve.servers import (BASELINE, BLOCK_PDL, DENSE_GEMV, FRONTEND, FUSED_ROUTER, NO_DENSE_GEMV, NO_EXPERT_STATS,
                                 NO_ROUTER, OURS,
                                 QK_NORM_ROPE,
                                 ROUTING_ENV, VARIANTS, VLLM_TRITON, EngineFlags, chosen_backends, command,
                                 config_differences, engine_config)

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def _cfg(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


# --- byte floor -----------------------------------------------------------------------------

def test_the_kv_cache_adds_each_sequences_cached_tokens_per_layer() -> None:
    cfg = _cfg("qwen3-30b-a3b")      # 48 layers, 4 KV heads of 128: 2 x 4 x 128 x 2 B = 2 KiB per token and layer
    assert roofline.kv_cache_bytes(cfg, 1, 8, 192) == 8 * 192 * 48 * 2048
    assert roofline.kv_cache_bytes(cfg, 8, 1, 100) == 100 * 48 * 2 * 1 * 128 * 2     # one KV head per rank
    mla = _cfg("deepseek-v3")        # the latent (512) and the rope key (64), bf16, on every rank
    assert roofline.kv_cache_bytes(mla, 8, 2, 10) == 2 * 10 * 61 * (512 + 64) * 2
    floor = roofline.byte_floor(cfg, 1, 8, 192)
    assert floor["total"] == roofline.decode_step_bytes(cfg, 1, 8)["total"] + floor["kv_cache"]


def test_mixtral_8x7b_reads_25_5_gb_per_decode_token() -> None:
    # per layer: q,o 2 x 4096 x 4096 + k,v 2 x 4096 x 8 x 128 = 41,943,040; router 8 x 4096;
    # 2 experts x 3 x 4096 x 14336 = 352,321,536; 2 norms x 4096 -> 394,305,536 x 32 layers;
    # lm_head 32000 x 4096, final norm and one embedding row 4096 each; bf16
    params = 394_305_536 * 32 + 32000 * 4096 + 4096 + 4096
    parts = roofline.decode_step_bytes(_cfg("mixtral-8x7b"))
    assert parts["total"] == 2 * params == 25_497_714_688
    assert parts["experts"] == 2 * 352_321_536 * 32 and parts["lm_head"] == 2 * 32000 * 4096
    # the 6.04 ms at the 4.22 TB/s copy ceiling
    assert roofline.decode_step_bytes(_cfg("mixtral-8x7b"))["total"] / 4.22e12 * 1e3 == pytest.approx(6.042, abs=1e-3)


def test_qwen3_30b_a3b_reads_6_1_gb_per_decode_token() -> None:
    # per layer: q,o 2 x 2048 x 32 x 128 = 16,777,216 + k,v 2 x 2048 x 4 x 128 = 2,097,152 + q/k norms
    # 2 x 128; router 128 x 2048; 8 experts x 3 x 2048 x 768 = 37,748,736; 2 norms x 2048; the
    # lm_head of its real 151,936-token vocabulary (0.62 GB)
    per_layer = 16_777_216 + 2_097_152 + 256 + 262_144 + 37_748_736 + 4096
    params = per_layer * 48 + 151936 * 2048 + 2048 + 2048
    assert roofline.decode_step_bytes(_cfg("qwen3-30b-a3b"))["total"] == 2 * params == 6_083_739_648
    assert roofline.decode_step_bytes(_cfg("qwen3-30b-a3b"))["lm_head"] == 2 * 151936 * 2048


def test_deepseek_v3_per_rank_bytes_at_tp8() -> None:
    # MLA per layer and rank: q_a 7168 x 1536 + its norm 1536 + q_b 1536 x 128 x 192 / 8
    # + kv_a 7168 x 576 + its norm 512 + kv_b 512 x 128 x 256 / 8 + o 128 x 128 x 7168 / 8 = 36,636,672
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 // 8 + 7168 * 576 + 512 + 512 * 128 * 256 // 8 + 16384 * 7168 // 8
    assert mla == 36_636_672
    dense = 3 * 7168 * 18432 // 8                                  # first 3 layers' MLP
    moe = 256 * 7168 + (8 + 1) * 3 * 7168 * 2048 // 8              # router, 8 routed + 1 shared expert
    params = 61 * (mla + 2 * 7168) + 3 * dense + 58 * moe + 129280 * 7168 // 8 + 7168 + 7168
    assert roofline.decode_step_bytes(_cfg("deepseek-v3"), tp=8)["total"] == 2 * params == 10_960_498_688


def test_tensor_parallel_shards_match_the_one_rank_configs() -> None:
    whole, rank = roofline.decode_step_bytes(_cfg("mixtral-8x7b"), tp=8), roofline.decode_step_bytes(
        _cfg("mixtral-8x7b-tp8-rank"))
    assert whole["experts"] == rank["experts"] and whole["attention"] == rank["attention"]
    assert whole["lm_head"] * 8 == rank["lm_head"]          # the rank config keeps the whole vocab


def test_batch_reads_the_expected_distinct_experts_and_fp8_halves_the_linear_layers() -> None:
    assert roofline.expected_experts_hit(8, 2, 1) == 2
    assert roofline.expected_experts_hit(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert roofline.expected_experts_hit(128, 8, 10_000) == pytest.approx(128)
    cfg = _cfg("mixtral-8x7b")
    fp8 = roofline.decode_step_bytes({**cfg, "quantization_config": {"quant_method": "fp8"}})
    bf16 = roofline.decode_step_bytes(cfg)
    assert fp8["experts"] * 2 == bf16["experts"] and fp8["attention"] * 2 == bf16["attention"]
    assert fp8["lm_head"] == bf16["lm_head"] and fp8["router"] == bf16["router"]
    with pytest.raises(ValueError, match="model_type"):
        roofline.decode_step_bytes({**cfg, "model_type": "llama"})


# --- run order and plan --------------------------------------------------------------------------

def test_three_variants_take_every_position_and_order_equally_often() -> None:
    plan = schedule.plan(list(VARIANTS), 6, frontend_every=1)
    orders = [[v for r, v in plan if r == k] for k in range(6)]
    assert all(sorted(o) == sorted(VARIANTS) for o in orders)
    assert set(Counter((i, v) for o in orders for i, v in enumerate(o)).values()) == {2}
    before = Counter((a, b) for o in orders for i, a in enumerate(o) for b in o[i + 1:])
    assert before[(BASELINE, OURS)] == before[(OURS, BASELINE)] == 3


def test_two_variants_alternate_and_the_frontend_runs_every_kth_round() -> None:
    assert [schedule.round_order([BASELINE, OURS], r)[0] for r in range(4)] == [BASELINE, OURS] * 2
    plan = schedule.plan(list(VARIANTS), 4, frontend_every=2)
    assert [r for r, v in plan if v == FRONTEND] == [0, 2]
    assert Counter(v for _, v in plan) == {BASELINE: 4, OURS: 4, FRONTEND: 2}


def test_warmup_and_request_counts() -> None:
    assert [schedule.warmup_count(c) for c in (1, 2, 3, 8, 32)] == [4, 4, 6, 8, 32]
    assert [schedule.requests_at(c, None) for c in (1, 2, 4, 8, 16, 32, 64)] == [32, 32, 64, 256, 256, 512, 1024]
    assert schedule.requests_at(64, 10) == 10


def _ratio(n: int, n_base: int, lo: float | None, hi: float | None) -> dict:
    return {"n": n, "n_base": n_base, "ratio": 1.1, "lo": lo, "hi": hi}


def test_a_primary_cell_asks_for_rounds_until_its_interval_has_its_processes() -> None:
    """3 + 3 processes at least, 4 + 4 where the interval is wider than 2 %; only the primary cells
    (c = 1 ITL, c = 8 tok/s) count, and not the frontend variant that runs every K-th round."""
    narrow, wide = _ratio(3, 3, 1.10, 1.11), _ratio(3, 3, 1.05, 1.15)
    assert schedule.processes_needed(narrow) == 3 and schedule.processes_needed(wide) == 4
    assert schedule.processes_needed(_ratio(1, 1, None, None)) == 4           # no interval yet
    rows = [{"level": 1, "variant": OURS, "itl_speedup": narrow, "tok_s_ratio": wide},
            {"level": 8, "variant": OURS, "itl_speedup": wide, "tok_s_ratio": narrow},
            {"level": 64, "variant": OURS, "tok_s_ratio": wide},
            {"level": 1, "variant": FRONTEND, "itl_speedup": _ratio(1, 3, None, None)}]
    assert schedule.more_rounds(rows) == []
    rows[0]["itl_speedup"] = wide
    assert schedule.more_rounds(rows) == ["c = 1 moe-serve: 3 + 3, [1.050, 1.150] needs 4 + 4"]
    rows[0]["itl_speedup"] = _ratio(4, 4, 1.05, 1.15)
    rows[1]["tok_s_ratio"] = _ratio(2, 2, 1.10, 1.11)
    assert schedule.more_rounds(rows) == ["c = 8 moe-serve: 2 + 2, [1.100, 1.110] needs 3 + 3"]


def test_every_variant_gets_the_same_engine_flags_in_its_own_spelling(tmp_path: Path) -> None:
    gpu = EngineFlags("dummy", 4096, 256, 2, 0.9, None)
    module, argv, env = command(BASELINE, tmp_path, gpu, tmp_path / "traces")
    assert module == "vllm.entrypoints.openai.api_server" and env == {"VLLM_PLUGINS": "", ROUTING_ENV: ""}
    text = " ".join(argv)
    for flag in ("--load-format dummy", "--max-model-len 4096", "--max-num-seqs 256",
                 "--tensor-parallel-size 2", "--gpu-memory-utilization 0.9", "--served-model-name yardstick"):
        assert flag in text
    assert json.loads(argv[argv.index("--profiler-config") + 1])["profiler"] == "torch"
    module, argv, env = command(FRONTEND, tmp_path, EngineFlags(None, 512, 8, 1, None, 1 << 29))
    assert module == "moe_serve.service" and env == {"MOE_SERVE_BLOCK_PDL": "0", ROUTING_ENV: ""}     # never inherited
    assert argv[argv.index("--moe-kernels") + 1] == "vllm"
    assert "kv_cache_memory_bytes=536870912" in argv and "--gpu-memory-utilization" not in argv
    assert command(OURS, tmp_path, gpu)[1][5] == "optimized"
    ours, fused, unfused = (command(v, tmp_path, gpu)[1] for v in (OURS, FUSED_ROUTER, NO_ROUTER))
    assert fused == ours + ["--fused-router"] and unfused == ours + ["--no-fused-router"]
    assert not any("fused-router" in a for a in ours)          # the default: on with our kernels
    assert command(BLOCK_PDL, tmp_path, gpu)[1:] == (ours, {"MOE_SERVE_BLOCK_PDL": "1", ROUTING_ENV: ""})
    assert command(NO_EXPERT_STATS, tmp_path, gpu)[1] == ours + ["--no-expert-stats"]   # on by default
    fused = command(QK_NORM_ROPE, tmp_path, gpu)[1]
    assert fused[:-2] == ours and fused[-2] == "--engine-arg"
    assert json.loads(fused[-1].split("=", 1)[1]) == {"pass_config": {"enable_qk_norm_rope_fusion": True}}
    assert command(DENSE_GEMV, tmp_path, gpu)[1] == ours + ["--dense-gemv"] and "--dense-gemv" not in ours
    assert command(NO_DENSE_GEMV, tmp_path, gpu)[1] == ours + ["--no-dense-gemv"]      # on by default
    assert command(OURS, tmp_path, gpu)[2] == {"MOE_SERVE_BLOCK_PDL": "0", ROUTING_ENV: ""}


def test_the_expert_load_mode_is_set_alike_in_every_server_and_the_triton_control_forces_the_backend(
        tmp_path: Path) -> None:
    uniform = EngineFlags("dummy", 4096, 256, 1, 0.9, None, routing="uniform_random")
    envs = {v: command(v, tmp_path, uniform)[2] for v in (BASELINE, VLLM_TRITON, FRONTEND, OURS)}
    assert {e[ROUTING_ENV] for e in envs.values()} == {"uniform_random"}
    base, triton = command(BASELINE, tmp_path, uniform)[1], command(VLLM_TRITON, tmp_path, uniform)[1]
    assert triton == base + ["--moe-backend", "triton"] and envs[VLLM_TRITON]["VLLM_PLUGINS"] == ""


CONFIG_LINE = ("(EngineCore pid=7) INFO 12-06 03:10:01 [core.py:93] Initializing a V1 LLM engine (v0.26.0) with "
               "config: model='/m', speculative_config=None, tokenizer='/m', dtype=torch.bfloat16, "
               "max_seq_len=4096, quantization=None, seed=0, served_model_name=yardstick, "
               "compilation_config={'level': 3, 'cudagraph_capture_sizes': [512, 256, 1], 'x': 'a, b'}, "
               "kernel_config=KernelConfig(ir_op_priority=IrOpPriorityConfig(rms_norm=['native']), "
               "moe_backend='auto', linear_backend='auto')\n")


def test_engine_config_reads_the_line_vllm_logs_and_splits_only_top_level_commas() -> None:
    cfg = engine_config("some start-up line\n" + CONFIG_LINE + "later line\n")
    assert cfg["max_seq_len"] == "4096" and cfg["served_model_name"] == "yardstick"
    assert cfg["compilation_config"] == "{'level': 3, 'cudagraph_capture_sizes': [512, 256, 1], 'x': 'a, b'}"
    assert cfg["kernel_config.moe_backend"] == "'auto'" and "kernel_config" not in cfg
    assert cfg["kernel_config.ir_op_priority.rms_norm"] == "['native']"
    assert engine_config("no such line\n") is None
    other = engine_config(CONFIG_LINE.replace("max_seq_len=4096", "max_seq_len=8192"))
    assert config_differences(cfg, other) == {"max_seq_len": ("4096", "8192")}
    assert config_differences(cfg, other, ignore=("max_seq_len",)) == {}


# --- same answers --------------------------------------------------------------------------------

def test_prompt_logprobs_give_each_positions_own_token_and_top1() -> None:
    ids = [11, 12, 13]
    said = [None, {"12": {"logprob": -1.5, "rank": 2}, "40": {"logprob": -0.5, "rank": 1}},
            {"13": {"logprob": -0.2, "rank": 1}}]
    assert answers.parse_prompt_logprobs(ids, said) == {"logprob": [-1.5, -0.2], "top1": [40, 13]}
    with pytest.raises(ValueError, match="lacks the prompt's token 13"):
        answers.parse_prompt_logprobs(ids, [None, said[1], {"40": {"logprob": -0.1, "rank": 1}}])
    with pytest.raises(ValueError, match="2 positions for 3"):
        answers.parse_prompt_logprobs(ids, said[:2])


def test_answers_compare_top1_agreement_and_the_largest_logprob_difference() -> None:
    a = {"prompts": [{"logprob": [-1.0, -2.0], "top1": [5, 6]}, {"logprob": [-3.0], "top1": [7]}]}
    b = {"prompts": [{"logprob": [-1.0, -2.25], "top1": [5, 9]}, {"logprob": [-2.9], "top1": [7]}]}
    c = answers.compare(a, b)
    assert c["positions"] == 3 and c["top1_agreement"] == pytest.approx(2 / 3)
    assert c["max_logprob_diff"] == pytest.approx(0.25)
    assert answers.compare(a, a) == {"positions": 3, "top1_agreement": 1.0, "max_logprob_diff": 0.0}


# --- statistics ----------------------------------------------------------------------------------

def _record(level: int, index: int, t0: float, ttft: float, gap_us: int, tokens: int = 8, **kw) -> dict:
    return {"level": level, "phase": "measured", "index": index, "status": "ok", "error": None, "t_start": t0,
            "t_end": t0 + ttft + (tokens - 1) * gap_us / 1e6, "ttft": ttft, "output_tokens": tokens,
            "chunks": tokens, "itl_us": [gap_us] * (tokens - 1), **kw}


def test_cell_medians_throughput_window_and_floor() -> None:
    recs = [_record(2, 0, 0.0, 0.010, 1000), _record(2, 1, 0.0, 0.030, 3000), _record(2, 2, 0.5, 0.020, 2000)]
    c = serve_stats.cell(recs, 8, floor_s=0.0005)
    assert c["itl_p50_ms"] == 2.0 and c["ttft_p50_ms"] == pytest.approx(20.0)
    assert c["tok_s"] == pytest.approx(24 / (0.5 + 0.020 + 0.014))         # last end - first start
    assert c["floor_pct"] == pytest.approx(25.0) and c["coalesced"] == 0
    recs[1]["chunks"] = 5
    assert serve_stats.cell(recs, 8, None)["coalesced"] == pytest.approx(1 / 3)
    recs[2].update(status="error", error="HTTP 500: boom")
    assert serve_stats.cell(recs, 8, None) == {"n_requests": 3, "errors": 1, "error": "HTTP 500: boom"}


def _proc(variant: str, rnd: int, itl: float, tok_s: float, ttft: float = 50.0) -> serve_stats.Process:
    meta = {"variant": variant, "round": rnd, "host": "h", "gpu": "H200", "commit": "abc", "dirty": False,
            "workload": {"model": "m", "levels": [1]}}
    cell = {"errors": 0, "itl_p50_ms": itl, "ttft_p50_ms": ttft, "tok_s": tok_s, "floor_pct": None, "coalesced": 0}
    return serve_stats.Process(Path("."), meta, {1: cell})


def _noisy(gain: float, noise: float, n: int, seed: int) -> list[serve_stats.Process]:
    rng = random.Random(seed)
    out = []
    for r in range(n):
        for v, g in ((BASELINE, 1.0), (OURS, gain)):
            f = math.exp(rng.gauss(0, noise))
            out.append(_proc(v, r, 4.0 / g * f, 250.0 * g / f, ttft=50.0 * f))
    return out


def test_speedup_interval_excludes_one_for_a_clear_gain() -> None:
    rows = serve_stats.pooled_rows(_noisy(1.2, 0.01, 5, seed=1), BASELINE, VARIANTS)
    ours = next(r for r in rows if r["variant"] == OURS)
    for key in ("itl_speedup", "tok_s_ratio"):          # both oriented: > 1 is better for ours
        assert 1.0 < ours[key]["lo"] < ours[key]["ratio"] < ours[key]["hi"] and ours[key]["n"] == 5
    assert ours["itl_speedup"]["ratio"] == pytest.approx(1.2, rel=0.03)
    assert ours["ttft_speedup"]["ratio"] == pytest.approx(1.0, rel=0.03)
    assert "itl_speedup" not in next(r for r in rows if r["variant"] == BASELINE)


def test_speedup_interval_includes_one_when_process_noise_swamps_the_gain() -> None:
    rows = serve_stats.pooled_rows(_noisy(1.03, 0.15, 4, seed=3), BASELINE, VARIANTS)
    ours = next(r for r in rows if r["variant"] == OURS)
    assert ours["itl_speedup"]["lo"] < 1.0 < ours["itl_speedup"]["hi"]


def test_speedup_is_the_ratio_of_geometric_means_and_failed_cells_are_left_out() -> None:
    procs = [_proc(BASELINE, 0, 4.0, 200.0, 40.0), _proc(BASELINE, 1, 9.0, 100.0, 60.0),
             _proc(OURS, 0, 2.0, 300.0, 40.0), _proc(OURS, 1, 8.0, 400.0, 50.0), _proc(OURS, 2, 1.0, 1.0)]
    procs[-1].cells[1] = {"errors": 2, "error": "x"}
    ours = next(r for r in serve_stats.pooled_rows(procs, BASELINE, VARIANTS) if r["variant"] == OURS)
    assert (ours["n"], ours["failed"]) == (2, 1)
    assert ours["itl_p50_ms"] == pytest.approx(4.0) and ours["itl_speedup"]["ratio"] == pytest.approx(6.0 / 4.0)
    assert ours["tok_s_ratio"]["ratio"] == pytest.approx(math.sqrt(300 * 400) / math.sqrt(200 * 100))


# --- kernel classes of a decode step -------------------------------------------------------------

@pytest.mark.parametrize("name,cls", [
    ("moe_decode_up_kernel", "expert GEMMs"), ("fused_moe_kernel", "expert GEMMs"), ("topk_sum_kernel", "expert GEMMs"),
    ("void vllm::moe::moe_sum_vec_kernel<c10::BFloat16, int, 2, false>(...)", "expert GEMMs"),
    ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4cute5tupleIJ", "expert GEMMs"),
    ("void vllm::moe::topkGating<8, 8, 4, 16, 32, int, __nv_bfloat16>(...)", "router top-k"),
    ("void vllm::moe::grouped_topk_kernel<float>(...)", "router top-k"),
    ("moe_align_kernel", "alignment"), ("void vllm::moe::moe_align_block_size_kernel<int>(...)", "alignment"),
    ("void tensorrt_llm::kernels::cutlass_kernels::expandInputRowsKernel<...>", "alignment"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(...)", "attention"),
    ("kernel_unified_attention", "attention"), ("reduce_segments", "attention"),     # vLLM's Triton backend
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "dense GEMMs"), ("dense_gemv_kernel", "dense GEMMs"),   # ours
    ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<...>>", "dense GEMMs"),
    ("triton_red_fused__to_copy_clamp_cutlass_scaled_mm_fused_add_rms_norm_mul_reciprocal_2", "norms/elementwise"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, ...>", "norms/elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "sampling"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", "sampling"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy/memset"), ("some_new_kernel", "other")])
def test_kernel_classes(name: str, cls: str) -> None:
    assert trace.kernel_class(name) == cls


def test_per_step_classes_take_long_minus_short_and_idle_is_the_rest_of_the_step() -> None:
    def summary(steps: int) -> dict:        # prefill 1000 us, then per step 30 us MoE, 20 us attention
        return {"kernels": {"prefill_gemm": [1, 1000.0], "moe_decode_up_kernel": [steps, 30.0 * steps],
                            "flash_attn_fwd": [steps, 20.0 * steps]}, "busy_us": 1000.0 + 50.0 * steps}

    d = trace.per_step_classes({"tokens": [4, 12], "short": summary(4), "long": summary(12)}, step_ms=0.2)
    assert d["expert GEMMs"] == pytest.approx(0.03) and d["attention"] == pytest.approx(0.02)
    assert d["dense GEMMs"] == 0 and d["busy_ms"] == pytest.approx(0.05) and d["gpu_idle_ms"] == pytest.approx(0.15)
    assert trace.overlap_ms(d) == pytest.approx(0.0)


def test_overlapping_kernels_show_as_overlap_so_the_slices_make_the_step() -> None:
    """With PDL the MoE kernel starts 10 us before attention ends: each class counts those 10 us,
    busy (the union) once; classes - overlap + idle = the step."""
    def summary(steps: int) -> dict:
        return {"kernels": {"moe_decode_up_kernel": [steps, 30.0 * steps], "flash_attn_fwd": [steps, 20.0 * steps]},
                "busy_us": 40.0 * steps}

    d = trace.per_step_classes({"tokens": [4, 12], "short": summary(4), "long": summary(12)}, step_ms=0.1)
    assert trace.overlap_ms(d) == pytest.approx(0.01)
    classes = sum(d[c] for c in trace.KERNEL_CLASSES)
    assert classes - trace.overlap_ms(d) + d["gpu_idle_ms"] == pytest.approx(0.1)


# --- files, rendering, refusals ------------------------------------------------------------------

def _write_process(out: Path, variant: str, rnd: int, workload: dict, gap_us: int,
                   api_cpu_s: float | None = None, config: dict | None = None, said: dict | None = None,
                   extra: dict | None = None) -> None:
    d = out / variant / f"r{rnd}"
    d.mkdir(parents=True)
    meta = {"variant": variant, "round": rnd, "host": "gpu-host", "gpu": "NVIDIA H200", "commit": "0123456789abc",
            "dirty": False, "workload": workload, "copy_ceiling_bps": 4e12, "floor_bytes": {"1": 4e9},
            "profiled": False, "end": 1.0, "wall_s": 100.0, "engine_config": config, **(extra or {})}
    (d / "meta.json").write_text(json.dumps(meta))
    if said is not None:
        (d / answers.ANSWERS).write_text(json.dumps(said))
    ttft = 0.05 + 0.001 * rnd
    (d / "requests.jsonl").write_text("\n".join(json.dumps(_record(1, i, i * 1.0, ttft, gap_us)) for i in range(4)))
    if api_cpu_s is not None:
        (d / serve_stats.API_CPU).write_text(json.dumps({"1": {"cpu_s": api_cpu_s, "requests": 8, "output_tokens": 64}}))
    (d / serve_stats.COMPLETE).write_text("{}")


WORK = {"model": "qwen3-30b-a3b", "config_sha256": "x", "levels": [1], "prompt_tokens": 128, "output_tokens": 8,
        "engine": {"load_format": "dummy", "max_model_len": 4096}}


def test_results_table_renders_ratios_floor_and_machines(tmp_path: Path) -> None:
    for r in range(2):
        _write_process(tmp_path, BASELINE, r, WORK, 4000 + 100 * r)
        _write_process(tmp_path, OURS, r, WORK, 2000 + 50 * r)
    text = "\n".join(serve_render.results_table(tmp_path))
    assert "Primary metrics" in text and "gpu-host (NVIDIA H200) at 0123456789: 4" in text
    base = next(ln for ln in text.splitlines() if f"| {BASELINE} |" in ln)
    ours = next(ln for ln in text.splitlines() if f"| {OURS} |" in ln)
    assert base.startswith("| qwen3-30b-a3b | 1 | vllm-serve | 2 | **4.050** | — |")
    # floor 4e9 B / 4e12 B/s = 1 ms against ITL 4.05 ms and 2.025 ms
    assert base.endswith("| 25 % |") and ours.endswith("| 49 % |")
    assert "| **2.025** | 2.000 [" in ours


def test_the_backends_vllm_chose_are_read_from_its_log_and_said_under_the_table(tmp_path: Path) -> None:
    log = ("INFO [topk_topp_sampler.py:47] FlashInfer not installed; using native top-p/top-k sampling.\n"
           "INFO [cuda.py:482] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN']\n"
           "INFO [fp8.py:405] Using TRITON Fp8 MoE backend out of potential backends: ['TRITON', 'DEEPGEMM']\n"
           "INFO Using TritonExperts MoE backend\n")
    assert chosen_backends(log) == {"moe": "TRITON", "attention": "FLASH_ATTN", "sampler": "native"}
    assert chosen_backends("Using FlashInfer for top-p & top-k sampling.\nUsing FLASHINFER_CUTLASS Fp8 MoE "
                           "backend out of potential backends") == {"moe": "FLASHINFER_CUTLASS", "sampler": "flashinfer"}
    assert chosen_backends("nothing logged") == {}
    _write_process(tmp_path / "old", BASELINE, 0, WORK, 4000)
    assert "chose" not in "\n".join(serve_render.results_table(tmp_path / "old"))       # runs before the record
    for r, fi in enumerate((None, "0.6.14")):
        _write_process(tmp_path / "new", BASELINE, r, WORK, 4000,
                       extra={"backends": chosen_backends(log), "flashinfer": fi})
    text = "\n".join(serve_render.results_table(tmp_path / "new"))
    assert ("`vllm serve` chose: MoE backend TRITON, attention FLASH_ATTN, sampler native; "
            "FlashInfer 0.6.14 / not installed.") in text


def test_api_cpu_per_token_is_tabled_where_recorded_with_its_ratio(tmp_path: Path) -> None:
    no_cpu = tmp_path / "none"
    _write_process(no_cpu, BASELINE, 0, WORK, 4000)
    _write_process(no_cpu, OURS, 0, WORK, 2000)
    assert "API CPU" not in "\n".join(serve_render.results_table(no_cpu))   # older runs render as before
    for r in range(2):   # 64 tokens per level: 0.0064 s -> 100 us/token; 0.0032 s -> 50 us/token
        _write_process(tmp_path / "cpu", BASELINE, r, WORK, 4000 + 100 * r, api_cpu_s=0.0064 * (1 + 0.1 * r))
        _write_process(tmp_path / "cpu", FRONTEND, r, WORK, 4000 + 50 * r, api_cpu_s=0.0032 * (1 + 0.2 * r))
    lines = serve_render.results_table(tmp_path / "cpu")
    cpu = [ln.split(" | ") for ln in lines if ln.startswith("| qwen3-30b-a3b | 1 |") and ln.count("|") == 7]
    assert [(r[2], r[3]) for r in cpu] == [(BASELINE, "2"), (FRONTEND, "2")]
    assert abs(float(cpu[0][4]) - 104.9) < 0.1 and abs(float(cpu[1][4]) - 54.8) < 0.1   # geomeans
    ratio = cpu[1][5].rstrip(" |")
    assert ratio.startswith("1.915 [") and cpu[0][5].rstrip(" |") == "—"   # 104.9 / 54.8


def test_process_cpu_seconds_count_this_process_work() -> None:
    from moe_serve.bench.serve.servers import process_cpu_s

    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert 0.15 <= process_cpu_s(os.getpid()) - before <= 5.0


def test_report_refuses_processes_whose_engine_ran_other_settings(tmp_path: Path) -> None:
    cfg = {"max_seq_len": "4096", "kernel_config.moe_backend": "'auto'"}
    triton = {**cfg, "kernel_config.moe_backend": "'triton'"}       # the switch of both variants
    _write_process(tmp_path, BASELINE, 0, WORK, 4000, config=cfg)
    _write_process(tmp_path, VLLM_TRITON, 0, WORK, 3900, config=triton)
    _write_process(tmp_path, OURS, 0, WORK, 3000, config=triton)
    _write_process(tmp_path, FRONTEND, 0, WORK, 4000, config=cfg)
    assert "| qwen3-30b-a3b | 1 | vllm-serve-triton |" in "\n".join(serve_render.results_table(tmp_path))
    _write_process(tmp_path, OURS, 1, WORK, 3000, config={**triton, "max_seq_len": "2048"})
    with pytest.raises(SystemExit, match=r"(?s)engine configuration differs.*moe-serve/r1: .*max_seq_len.*'4096', '2048'"):
        serve_render.results_table(tmp_path)


def test_answers_are_tabled_against_the_baselines_first_process_with_its_noise_floor(tmp_path: Path) -> None:
    ref = {"prompts": [{"logprob": [-1.0, -2.0], "top1": [5, 6]}]}
    _write_process(tmp_path, BASELINE, 0, WORK, 4000, said=ref)
    _write_process(tmp_path, BASELINE, 1, WORK, 4000, said=ref)
    _write_process(tmp_path, OURS, 0, WORK, 3000, said={"prompts": [{"logprob": [-1.0, -2.5], "top1": [5, 7]}]})
    _write_process(tmp_path, OURS, 1, WORK, 3000, said={"prompts": [{"logprob": [-1.1, -2.0], "top1": [5, 6]}]})
    lines = serve_render.results_table(tmp_path)
    rows = [ln for ln in lines if ln.startswith("| qwen3-30b-a3b | ") and ln.count("|") == 7]
    assert rows == ["| qwen3-30b-a3b | vllm-serve | 1 | 2 | 1.0000 | 0.0000 |",
                    "| qwen3-30b-a3b | moe-serve | 2 | 2 | 0.5000 | 0.5000 |"]


def test_report_refuses_to_pool_runs_of_different_workloads(tmp_path: Path) -> None:
    _write_process(tmp_path / "a", BASELINE, 0, WORK, 4000)
    _write_process(tmp_path / "b", BASELINE, 0, {**WORK, "output_tokens": 128}, 4000)
    with pytest.raises(SystemExit, match="different workloads"):
        serve_render.results_table(tmp_path / "a", tmp_path / "b")


def test_run_stops_before_a_process_the_budget_cannot_hold(tmp_path: Path, capsys) -> None:
    code = serve_ab.main(["--model", "embedded", "--out", str(tmp_path), "--budget-s", "100",
                          "--expect-process-s", "300", "--concurrency", "1"])
    assert code == 3
    assert "s left < 360 s for vllm-serve; stopping with 8 processes to go" in capsys.readouterr().out
    assert not (tmp_path / BASELINE).exists()


def test_run_refuses_an_out_dir_of_another_workload(tmp_path: Path, capsys) -> None:
    _write_process(tmp_path, BASELINE, 0, WORK, 4000)
    assert serve_ab.main(["--model", "embedded", "--out", str(tmp_path), "--concurrency", "1"]) == 2
    assert "ran another workload" in capsys.readouterr().out


def test_switch_and_attention_variants_start_what_they_name() -> None:
    """`moe-serve+<setting>` turns the plugin settings on through their MOE_SERVE_* overrides (names
    the plugin's config knows); `<server>+<tweak>` adds one vLLM attention flag in that server's spelling."""
    from moe_serve.kernels.config import PluginConfig, env_name

    f = servers.EngineFlags("dummy", 4096, 256, 1, 0.9, None)
    _, argv, env = servers.command("moe-serve+fused", Path("/m"), f)
    assert {k: v for k, v in env.items() if k.startswith("MOE_SERVE_FUSE")} == {
        env_name("fuse_norm_gemv"): "1", env_name("fuse_qk_norm_rope"): "1"}
    for settings in servers.SWITCHES.values():
        assert set(settings) <= set(PluginConfig.model_fields)
    module, argv, env = servers.command("vllm-serve+fa3-one-split", Path("/m"), f)
    assert module.startswith("vllm.") and env["VLLM_PLUGINS"] == ""
    assert argv[-2:] == ["--attention-config", '{"flash_attn_max_num_splits_for_cuda_graph": 1}']
    _, argv, env = servers.command("moe-serve+triton-attn", Path("/m"), f)
    assert argv[-2:] == ["--engine-arg", 'attention_backend="TRITON_ATTN"'] and "MOE_SERVE_FUSE_NORM_GEMV" not in env
    with pytest.raises(ValueError, match="unknown variant"):
        servers.command("moe-serve+nothing", Path("/m"), f)
