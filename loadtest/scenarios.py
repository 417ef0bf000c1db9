"""Scenario definitions shared by the Locust and asyncio engines.

A scenario is a schedule of stages (users held for some seconds) plus a seeded request
picker. Every request uses `ignore_eos` and a fixed `max_tokens`, so output lengths are known.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from moe_serve.loadtest.prompts import prompt

SCENARIOS = ("step", "mixed", "burst", "spike-sizes")


@dataclass(frozen=True)
class Stage:
    """`users` concurrent closed-loop users held for `seconds`, starting at `start` (s)."""

    label: str
    users: int
    seconds: float
    start: float = 0.0

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass(frozen=True)
class RequestSpec:
    """One request: which kind (for reports), endpoint, prompt text and output length."""

    kind: str
    endpoint: str  # "chat" | "completions"
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Options:
    """Knobs of every scenario (CLI flags)."""

    max_users: int = 256
    step_seconds: float = 30.0
    max_tokens: int = 128
    prompt_words: int = 128
    seed: int = 0


@dataclass
class Scenario:
    name: str
    options: Options
    stages: list[Stage]
    picker: Callable[[random.Random], RequestSpec] = field(repr=False)

    @property
    def duration(self) -> float:
        return self.stages[-1].end if self.stages else 0.0

    def stage_index(self, t: float) -> int:
        """Index of the stage running at `t` seconds after start (the last one after the end)."""
        for i, st in enumerate(self.stages):
            if t < st.end:
                return i
        return len(self.stages) - 1

    def user_rng(self, user: int) -> random.Random:
        """The request stream of user `user`: the same on every run with the same seed."""
        return random.Random(f"{self.options.seed}:{self.name}:{user}")

    def describe(self) -> dict:
        return {"name": self.name, "options": asdict(self.options), "stages": [asdict(s) for s in self.stages]}


def _timeline(pairs: list[tuple[str, int]], seconds: float) -> list[Stage]:
    return [Stage(label, users, seconds, i * seconds) for i, (label, users) in enumerate(pairs)]


def doubling(max_users: int) -> list[int]:
    """1, 2, 4, ... up to and including `max_users`."""
    out, u = [], 1
    while u < max_users:
        out.append(u)
        u *= 2
    return out + [max_users]


def _step_picker(o: Options) -> Callable[[random.Random], RequestSpec]:
    def pick(rng: random.Random) -> RequestSpec:
        endpoint = rng.choice(("chat", "completions"))
        return RequestSpec("fixed", endpoint, prompt(rng, o.prompt_words), o.max_tokens)
    return pick


def _mixed_picker(o: Options) -> Callable[[random.Random], RequestSpec]:
    m, w = o.max_tokens, o.prompt_words

    def pick(rng: random.Random) -> RequestSpec:
        r = rng.random()
        if r < 0.5:
            return RequestSpec("short-chat", "chat", prompt(rng, rng.randint(max(1, w // 8), max(1, w // 2))),
                               rng.randint(max(1, m // 8), max(1, m // 2)))
        if r < 0.75:
            return RequestSpec("summarize", "completions",
                               prompt(rng, rng.randint(4 * w, 8 * w), "Summarize the following text:"),
                               rng.randint(max(1, m // 4), max(1, m // 2)))
        return RequestSpec("long-generation", "chat", prompt(rng, rng.randint(max(1, w // 8), max(1, w // 4)),
                           "Write a long story about"), rng.randint(2 * m, 4 * m))
    return pick


def _spike_picker(o: Options) -> Callable[[random.Random], RequestSpec]:
    def pick(rng: random.Random) -> RequestSpec:
        return RequestSpec("spike", rng.choice(("chat", "completions")), prompt(rng, rng.randint(1, 4 * o.prompt_words)),
                           rng.randint(1, 2 * o.max_tokens))
    return pick


def build(name: str, options: Options) -> Scenario:
    """The named scenario with these options."""
    o, s = options, options.step_seconds
    if name == "step":
        return Scenario(name, o, _timeline([(f"u{u}", u) for u in doubling(o.max_users)], s), _step_picker(o))
    if name == "spike-sizes":
        return Scenario(name, o, _timeline([(f"u{u}", u) for u in doubling(o.max_users)], s), _spike_picker(o))
    if name == "mixed":
        return Scenario(name, o, _timeline([("mixed", o.max_users)], 3 * s), _mixed_picker(o))
    if name == "burst":
        stages = _timeline([("idle-before", 0), ("burst", o.max_users), ("idle-after", 0)], s)
        return Scenario(name, o, stages, _step_picker(o))
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
