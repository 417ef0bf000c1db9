"""The search over vLLM's fused-MoE configs for one layer shape and format, within a time budget.

Works through a `Bench` (timing, correctness check and compiles of vLLM's kernel; a fake one in
the tests) and a clock, so the budget logic is the same on the GPU and under test:
  0. seeds: every M key's baseline (what vLLM runs without a table: its shipped table for this
     GPU, else its default) is timed and becomes the reference of the correctness check, even
     past the budget; then the seeds (every shipped table's configs, neighbour M keys' defaults);
  1. decode M keys (<= DECODE_MAX_M) until DECODE_SHARE of the budget: rounds of the walk from
     each key's best through vLLM's search space (one key changed, then two, then the rest of
     the space nearest first); a config that becomes one key's best is timed at every key;
  2. larger M keys until LARGE_SHARE: the same walk;
  3. the rest: each key's three fastest and its baseline timed again, twice, interleaved
     (more replays); the fastest wins.
A candidate that would become a key's best is first checked against the baseline's output on
inputs of its own; one that fails is never chosen (and is counted).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from moe_serve.kernels.tuning import vllm_space as space
from moe_serve.kernels.tuning.vllm_space import Config

DECODE_SHARE = 0.75
LARGE_SHARE = 0.9
FINAL_TOP = 3
ROUND_CAP = 24              # configs a key proposes per round (rounds end near the deadlines)


class Bench(Protocol):
    """vLLM's kernel on one shape and format (moe_serve.kernels.tuning.vllm_bench on the GPU)."""

    gate_tol: float

    def baseline(self, M: int) -> Config:
        """What vLLM runs at M without a tuned table."""

    def reference(self, M: int) -> float:
        """Run the baseline on M's check inputs, keep its output as the reference; its error
        against float64 (raises vllm_bench.BaselineMismatch beyond the format's tolerance)."""

    def time(self, M: int, cfg: Config, final: bool = False) -> float:
        """us per call at M (final: more replays); inf when it cannot run."""

    def check(self, M: int, cfg: Config) -> float:
        """cfg's output on M's check inputs: its error against the reference (inf: not finite)."""

    def compile(self, jobs: dict[tuple, tuple[Config, list[int]]], deadline: float) -> tuple[set, set]:
        """Compile {key: (config, M keys)} ahead of timing; (compiled keys, failed keys)."""


def key(cfg: Config) -> tuple:
    return tuple(cfg[k] for k in space.KEYS)


@dataclass
class KeyState:
    """One M key's search: every timing, the check results, the best checked config."""

    M: int
    baseline: Config
    times: dict[tuple, float] = field(default_factory=dict)
    cfgs: dict[tuple, Config] = field(default_factory=dict)
    source: dict[tuple, str] = field(default_factory=dict)
    passed: dict[tuple, float] = field(default_factory=dict)     # key -> error vs reference
    failed: dict[tuple, float] = field(default_factory=dict)
    schedules: dict[tuple, tuple] = field(default_factory=dict)  # schedule key -> config key
    best: tuple | None = None
    reference_error: float = float("nan")   # the baseline's error against float64
    level: int = 0           # 0: one-key walk, 1: two-key walk, 2: the rest of the space

    def best_us(self) -> float:
        return self.times[self.best] if self.best else float("inf")


@dataclass
class Search:
    """The search for one shape and format; run() returns {M: result dict}."""

    bench: Bench
    ms: tuple[int, ...]
    E: int
    N: int
    K: int
    topk: int
    fmt: str
    seeds: dict[int, list[tuple[Config, str]]]
    budget_s: float
    clock: Callable[[], float] = time.perf_counter
    log: Callable[[str], None] = lambda line: None
    states: dict[int, KeyState] = field(default_factory=dict)
    compile_failed: set = field(default_factory=set)
    compiled: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.space = space.prune(space.search_space(self.fmt), self.fmt, self.N, self.K)

    # ---- timing one candidate at one key ----------------------------------------------------
    def try_config(self, M: int, cfg: Config, source: str) -> None:
        st = self.states[M]
        k = key(cfg)
        if k in st.times or k in self.compile_failed:
            return
        sched = space.schedule_key(cfg, M, self.E, self.topk)
        if sched in st.schedules:                  # the same programs as one timed already
            st.times[k] = st.times[st.schedules[sched]]
            st.cfgs[k], st.source[k] = cfg, source
            return
        us = self.bench.time(M, cfg)
        st.times[k], st.cfgs[k], st.source[k] = us, cfg, source
        st.schedules[sched] = k
        if us < st.best_us():
            err = self.bench.check(M, cfg)
            if err <= self.bench.gate_tol:
                st.passed[k], st.best = err, k
            else:
                st.failed[k] = err
                self.log(f"  M={M}: {cfg} fails the check (error {err:.3g} vs the baseline)")

    def _compile(self, cands: dict[tuple, tuple[Config, list[int]]], deadline: float) -> set:
        todo = {k: v for k, v in cands.items() if k not in self.compiled | self.compile_failed}
        if todo:
            ok, bad = self.bench.compile(todo, deadline)
            self.compiled |= ok
            self.compile_failed |= bad
        return {k for k in cands if k in self.compiled}

    # ---- phases ----------------------------------------------------------------------------
    def seed(self, deadline_decode: float, deadline_large: float) -> None:
        self._compile({key(st.baseline): (st.baseline, [M]) for M, st in self.states.items()},
                      float("inf"))
        for M, st in self.states.items():                     # baselines: always, first
            k = key(st.baseline)
            st.times[k], st.cfgs[k], st.source[k] = self.bench.time(M, st.baseline), st.baseline, "baseline"
            st.reference_error, st.passed[k], st.best = self.bench.reference(M), 0.0, k
            st.schedules[space.schedule_key(st.baseline, M, self.E, self.topk)] = k
        for group, deadline in ((self._decode(), deadline_decode), (self._large(), deadline_large)):
            jobs: dict[tuple, tuple[Config, list[int]]] = {}
            for M in group:
                for cfg, _ in self.seeds.get(M, []):
                    jobs.setdefault(key(cfg), (cfg, []))[1].append(M)
            ready = self._compile(jobs, deadline)
            for M in group:
                for cfg, source in self.seeds.get(M, []):
                    if self.clock() > deadline:
                        break
                    if key(cfg) in ready:
                        self.try_config(M, cfg, source)

    def proposals(self, M: int) -> list[Config]:
        """The next configs M's walk times (empty: its walk is done)."""
        st = self.states[M]
        best = st.cfgs[st.best]
        while st.level <= 2:
            if st.level == 2:
                cands = space.by_distance(self.space, best)
            else:
                cands = space.neighbours(best, self.fmt, self.N, self.K, pairs=st.level == 1)
            new = [c for c in cands if key(c) not in st.times and key(c) not in self.compile_failed]
            if new:
                return new[:ROUND_CAP]
            st.level += 1
        return []

    def walk(self, group: list[int], deadline: float) -> None:
        """Rounds until the deadline: each key times its own proposals, then every key times the
        configs that became another key's best in the round."""
        while self.clock() < deadline:
            props = {M: self.proposals(M) for M in group}
            if not any(props.values()):
                return
            jobs = {key(c): (c, list(group)) for cands in props.values() for c in cands}
            ready = self._compile(jobs, deadline)
            before = {M: self.states[M].best for M in group}
            for M in group:
                for c in props[M]:
                    if self.clock() >= deadline:
                        return
                    if key(c) in ready:
                        self.try_config(M, c, "search")
            won = [self.states[M].cfgs[self.states[M].best] for M in group
                   if self.states[M].best != before[M]]
            for M in group:
                for c in won:
                    if self.clock() >= deadline:
                        return
                    self.try_config(M, c, "search")
            for M in group:
                st = self.states[M]
                st.level = 0 if st.best != before[M] else min(st.level + 1, 2)

    def final(self, deadline: float) -> None:
        """Each key's three fastest checked configs and its baseline, timed again twice."""
        for M in self.ms:
            st = self.states[M]
            if self.clock() >= deadline:
                return
            top = sorted(st.passed, key=lambda k: st.times[k])[:FINAL_TOP]
            finalists = list(dict.fromkeys(top + [key(st.baseline)]))
            if len(finalists) < 2:
                continue
            runs: dict[tuple, list[float]] = {k: [] for k in finalists}
            for _ in range(2):
                for k in finalists:
                    runs[k].append(self.bench.time(M, st.cfgs[k], final=True))
            for k, ts in runs.items():
                st.times[k] = sum(ts) / len(ts)
            st.best = min(finalists, key=lambda k: st.times[k])

    def _decode(self) -> list[int]:
        return [M for M in self.ms if M <= space.DECODE_MAX_M]

    def _large(self) -> list[int]:
        return [M for M in self.ms if M > space.DECODE_MAX_M]

    def run(self) -> dict[int, dict[str, Any]]:
        t0 = self.clock()
        d_decode, d_large = t0 + DECODE_SHARE * self.budget_s, t0 + LARGE_SHARE * self.budget_s
        for M in self.ms:
            self.states[M] = KeyState(M, self.bench.baseline(M))
        self.seed(d_decode, d_large)
        self.log(f"  seeds timed at {self.clock() - t0:.0f}s")
        self.walk(self._decode(), d_decode)
        self.log(f"  decode keys walked at {self.clock() - t0:.0f}s")
        self.walk(self._large(), d_large)
        self.final(t0 + self.budget_s)
        return {M: self.result(M) for M in self.ms}

    def result(self, M: int) -> dict[str, Any]:
        st = self.states[M]
        base_us = st.times[key(st.baseline)]
        in_space = {key(c) for c in self.space}
        return {"config": st.cfgs[st.best], "source": st.source[st.best], "us": st.best_us(),
                "baseline_us": base_us, "speedup": base_us / st.best_us(),
                "check_error": st.passed[st.best], "baseline_error_f64": st.reference_error,
                "timed": len(st.times),
                "space_timed": len(in_space & set(st.times)), "space_size": len(in_space),
                "check_failed": len(st.failed)}
