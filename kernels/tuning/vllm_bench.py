"""vLLM's own fused-MoE kernel on one layer shape and format, as moe_serve.kernels.tuning.vllm_search times
and checks it (its `Bench`).

Timing: vLLM's fused_experts with the config forced through its override_config, CUDA-graph
replay of rotating input sets (8 routings at decode M keys, 4 above, 1 on CPU: each call's
experts mostly miss the L2 left by the last; moe_serve.kernels.tuning.timing). Check: each M key has inputs of its own;
the baseline's output on them (what vLLM runs without a table) is checked against float64 and
kept as the reference, and a candidate's output must match it (relative L2 error) before it can
win. Before each checked call the allocator's free blocks of vLLM's buffer sizes are filled with
NaN and its output is NaN-filled once read, so a candidate that skips writing cannot inherit an
earlier correct output. On CPU (tests) `experts` stands in for fused_experts and timing is wall
clock.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from moe_serve.kernels.moe import quant_format, vllm_kernels
from moe_serve.kernels.tuning import vllm_space as space
from moe_serve.kernels.tuning.timing import make_vllm_problem, time_graph, vllm_runner
from moe_serve.kernels.tuning.vllm_space import Config

GATE_TOL = {False: 0.02, True: 0.05}        # vs the baseline's output (fp8: requantized SiLU)
F64_TOL = {False: 0.03, True: 0.15}         # baseline vs float64 (fp8: activations rounded)
REPLAYS = (6, 25)                           # screening, final (CPU: wall clock, 2 rounds)
CHECK_SEED = 1 << 20


class BaselineMismatch(RuntimeError):
    """vLLM's baseline config disagrees with float64 on the check inputs."""


class VllmBench:
    """vllm_search.Bench for vLLM's kernel on (E, N per rank, K, topk) in format `fmt`."""

    def __init__(self, E: int, N: int, K: int, topk: int, fmt: str, device: str,
                 experts: Callable | None = None, compiler: Any | None = None,
                 replays: tuple[int, int] = REPLAYS) -> None:
        self.E, self.N, self.K, self.topk, self.fmt, self.device = E, N, K, topk, fmt, device
        self.experts, self.compiler = experts, compiler
        self.replays = replays if device == "cuda" else (2, 2)
        self.fp8 = quant_format.is_fp8(fmt)
        self.gate_tol = GATE_TOL[self.fp8]
        self.weights: tuple | None = None
        self.probs: dict[tuple[int, bool], dict[str, Any]] = {}
        self.refs: dict[int, torch.Tensor] = {}

    def problem(self, M: int, check: bool = False) -> dict[str, Any]:
        """M's timing inputs (rotating sets) or its check inputs (one set, seeds of their own)."""
        if (M, check) not in self.probs:
            n_sets = 1 if check or self.device == "cpu" else 8 if M <= space.DECODE_MAX_M else 4
            prob = make_vllm_problem(self.E, self.N, self.K, self.topk, M, self.fmt, n_sets,
                                     self.device, seed=M + (CHECK_SEED if check else 0),
                                     weights=self.weights)
            self.weights = prob["weights"]
            self.probs[(M, check)] = prob
        return self.probs[(M, check)]

    def baseline(self, M: int) -> Config:
        """vLLM's own pick at M: its shipped table for this GPU, else its default."""
        picked = vllm_kernels.moe_config(M, self.E, self.N, self.K, self.topk, self.fmt)
        cfg = space.canonical({"GROUP_SIZE_M": 1, **picked}) if picked else None
        return cfg or space.default_config(M, self.E, self.N, self.K, self.topk, self.fmt)

    def time(self, M: int, cfg: Config, final: bool = False) -> float:
        prob = self.problem(M)
        try:
            return time_graph(vllm_runner(prob, cfg, self.experts), len(prob["sets"]),
                              self.replays[1 if final else 0])
        except Exception:  # noqa: BLE001 - out of resources, compile errors: this config cannot run
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return float("inf")

    def _output(self, M: int, cfg: Config) -> torch.Tensor:
        self._poison(M)
        return vllm_runner(self.problem(M, check=True), cfg, self.experts)(0)

    def reference(self, M: int) -> float:
        out = self._output(M, self.baseline(M))
        err = rel_err(out, moe_float64(self.problem(M, check=True)))
        if not err <= F64_TOL[self.fp8]:
            raise BaselineMismatch(f"vLLM's baseline config at M={M} is {err:.3g} off float64 "
                                 f"(tolerance {F64_TOL[self.fp8]}); not tuning {self.fmt}")
        self.refs[M] = out.clone()
        out.fill_(float("nan"))
        return err

    def check(self, M: int, cfg: Config) -> float:
        try:
            out = self._output(M, cfg)
        except Exception:  # noqa: BLE001 - a config that cannot run fails its check
            return float("inf")
        err = rel_err(out, self.refs[M].double())
        out.fill_(float("nan"))
        return err if err == err else float("inf")

    def _poison(self, M: int) -> None:
        """NaN into the free blocks vLLM's call allocates next: its caches, activations, output."""
        dt = self.problem(M, check=True)["sets"][0][0].dtype
        slots = M * self.topk
        sizes = (slots * max(2 * self.N, self.K), slots * self.N, M * self.K)
        bufs = [torch.full((n,), float("nan"), dtype=dt, device=self.device) for n in sizes]
        del bufs

    def compile(self, jobs: dict[tuple, tuple[Config, list[int]]],
                deadline: float) -> tuple[set, set]:
        if self.compiler is None:              # CPU: the interpreter compiles nothing
            return set(jobs), set()
        return self.compiler.compile(jobs, deadline)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN when out holds a NaN)."""
    out = out.double()
    return float((out - ref).norm() / ref.norm())


def _dequant(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None) -> torch.Tensor:
    """One expert's [R, C] weights in float64 with its scale ([] tensor, [R] channel, or
    [cdiv(R, bn), cdiv(C, bk)] block)."""
    w = w.double()
    if scale is None:
        return w
    s = scale.double()
    if block:
        s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:w.shape[0], :w.shape[1]]
    elif s.numel() > 1:
        s = s.reshape(-1, 1)
    return w * s


def moe_float64(prob: dict[str, Any]) -> torch.Tensor:
    """out[m] = sum_j w_mj * W2[e] (silu(W1g[e] x) * W1u[e] x) in float64 for prob's first input
    set (fp8 weights dequantized; activations unrounded), [M, K]."""
    x, tw, ids = prob["sets"][0]
    w1, w2, s1, s2 = prob["weights"]
    block = prob["fp8"].block_shape if prob["fp8"] is not None else None
    X = x.double()
    N = w1.shape[1] // 2
    out = torch.zeros(X.shape, dtype=torch.float64, device=X.device)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        W1 = _dequant(w1[e], None if s1 is None else s1[e], block)
        W2 = _dequant(w2[e], None if s2 is None else s2[e], block)
        h = X[rows] @ W1.T                                              # [n, 2N]
        a = torch.nn.functional.silu(h[:, :N]) * h[:, N:]               # [n, N]
        out.index_add_(0, rows, (a @ W2.T) * tw[rows, slots].double()[:, None])
    return out
