"""The structured-output checker (service/grammar_checker.py + its process, service/grammar_worker.py)
decides by conversion and soundness within a CPU-time budget, never by how long the engine's
compile takes: the same verdicts on an idle core and on one a busy process shares.

Pattern-heavy schemas of 500 and 900 properties (the 900 one: 6 s of xgrammar compile for the
embedded model's vocabulary without free whitespace) pass a 0.5 s budget, because converting them
takes milliseconds; a pattern that takes minutes to convert is refused at that budget, loaded or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from moe_serve.service.grammar_checker import CheckFailed, GrammarChecker

BUDGET_S = 0.5


def pattern_schema(n: int, tag: int = 0) -> dict:
    """n required string properties, each `[a-z]{2,30}[0-9]{1,5}` (the first's bound is `tag`-dependent,
    so a schema per tag is new to any cache); 900 of them are 64 KB, under the size limit."""
    names = [f"p{i}" for i in range(n)]
    props = {k: {"type": "string", "pattern": "[a-z]{2,30}[0-9]{1,5}"} for k in names}
    props["p0"] = {"type": "string", "pattern": f"[a-z]{{2,{30 + tag}}}[0-9]{{1,5}}"}
    return {"type": "object", "properties": props, "required": names}


SLOW_TO_CONVERT = {"type": "string", "pattern": "^[a-z]{1,30000}$"}  # minutes for xgrammar


class Hog:
    """A process spinning on `core` (at the same priority as the checker) while in use."""

    def __init__(self, core: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     preexec_fn=lambda: os.sched_setaffinity(0, {core}))

    def __enter__(self) -> Hog:
        return self

    def __exit__(self, *_: object) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def checker(loop: asyncio.AbstractEventLoop) -> Iterator[tuple[GrammarChecker, int]]:
    """The real checker process at the embedded model's setting (no free whitespace in JSON), pinned
    to one core (its per-check children inherit it): (checker, core)."""
    checker = GrammarChecker(BUDGET_S, max_parallel=2)
    loop.run_until_complete(checker.spawn())
    core = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(checker._proc.pid, {core})
    loop.run_until_complete(checker.configure(any_whitespace=False, timeout_s=120))
    yield checker, core
    loop.run_until_complete(checker.close())


def _check(loop: asyncio.AbstractEventLoop, checker: GrammarChecker, schema: dict) -> str | None:
    """None if the schema passed, else the refusal's reason ('budget': the CPU budget ran out)."""
    try:
        loop.run_until_complete(checker.check([("json", json.dumps(schema))]))
    except CheckFailed as failed:
        return failed.reason or "budget"
    return None


@pytest.mark.parametrize("loaded", [False, True], ids=["idle core", "loaded core"])
def test_verdicts_are_the_same_on_an_idle_and_a_loaded_core(checker, loop, loaded: bool) -> None:
    checker_, core = checker
    tag = 1 + loaded                                      # new schemas: no cached verdict
    with Hog(core) if loaded else contextlib.nullcontext():
        verdicts = {n: _check(loop, checker_, pattern_schema(n, tag)) for n in (500, 900)}
        slow = _check(loop, checker_, {**SLOW_TO_CONVERT, "minLength": tag})
    assert verdicts == {500: None, 900: None}             # the engine compiles them, not the check
    assert slow == "budget"

