"""After building the engine, the start freezes the start-up heap out of the GC (no 0.8 s full-GC pauses)."""

from __future__ import annotations

import gc
import re

import pytest

from moe_serve.loadtest.server_proc import ServerProcess
from moe_serve.service.engine import freeze_startup_heap


def test_freeze_moves_live_objects_out_of_the_collector() -> None:
    if gc.get_freeze_count():
        pytest.skip("another test froze the heap of this process")
    keep = [[i] for i in range(50_000)]  # 50k tracked lists alive now

    def tracked(obj: object) -> bool:  # in a generation the collector scans
        return any(o is obj for o in gc.get_objects())

    assert tracked(keep[-1])
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(keep)
        assert not tracked(keep[-1])
    finally:
        gc.unfreeze()


@pytest.mark.engine
def test_server_froze_its_startup_heap(server: ServerProcess) -> None:
    froze = re.search(r"froze (\d+) startup objects", server.log())
    assert froze, "no GC freeze logged at engine start"
    assert int(froze.group(1)) > 100_000  # torch + vLLM + tokenizer: ~650k on the CPU engine

