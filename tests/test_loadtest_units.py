"""Unit tests of the load-test building blocks (no server)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from moe_serve.loadtest import expert_load, prom
from moe_serve.loadtest.records import Record
from moe_serve.loadtest.scenarios import SCENARIOS, Options, build, doubling
from moe_serve.loadtest.stats import percentile, tokens_in_window
from moe_serve.loadtest.stream import StreamTimer, error_message, request_body


def test_doubling_ladder_reaches_max() -> None:
    assert doubling(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert doubling(6) == [1, 2, 4, 6]
    assert doubling(1) == [1]


def test_step_stages_are_contiguous_and_indexed() -> None:
    sc = build("step", Options(max_users=8, step_seconds=5))
    assert [s.users for s in sc.stages] == [1, 2, 4, 8]
    assert [s.start for s in sc.stages] == [0, 5, 10, 15] and sc.duration == 20
    assert [sc.stage_index(t) for t in (0, 4.99, 5, 19.9, 25)] == [0, 0, 1, 3, 3]


@pytest.mark.parametrize("name", SCENARIOS)
def test_pickers_are_seeded_and_fixed_length(name: str) -> None:
    a, b = build(name, Options(seed=7)), build(name, Options(seed=7))
    ra, rb = a.user_rng(3), b.user_rng(3)
    specs = [a.picker(ra) for _ in range(50)]
    assert specs == [b.picker(rb) for _ in range(50)]
    assert specs != [a.picker(a.user_rng(4)) for _ in range(50)]
    assert all(s.max_tokens >= 1 and s.prompt and s.endpoint in ("chat", "completions") for s in specs)


def test_spike_sizes_vary_and_mixed_has_all_kinds() -> None:
    sc = build("spike-sizes", Options(max_tokens=64, prompt_words=64))
    rng = sc.user_rng(0)
    specs = [sc.picker(rng) for _ in range(40)]
    assert len({s.max_tokens for s in specs}) > 25 and len({len(s.prompt.split()) for s in specs}) > 25
    mixed = build("mixed", Options())
    rng = mixed.user_rng(0)
    assert {mixed.picker(rng).kind for _ in range(200)} == {"short-chat", "summarize", "long-generation"}


def test_burst_is_idle_burst_idle() -> None:
    assert [s.users for s in build("burst", Options(max_users=32)).stages] == [0, 32, 0]


def locust_eval(expr: str, **data) -> object:
    """Evaluate `expr` with locust.stats imported, in a subprocess (importing locust here would
    gevent-monkey-patch the whole pytest process)."""
    code = ("import json, sys; from locust import stats; d = json.loads(sys.stdin.read()); "
            f"print(json.dumps({expr}))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(data), capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_percentile_matches_locust_definition() -> None:
    rng = random.Random(1)
    cases = []
    for n in (1, 2, 7, 100, 1001):
        values = [rng.randint(1, 99) for _ in range(n)]  # < 100 ms: Locust keeps exact integers
        cases.append(values)
    expr = ("[[stats.calculate_response_time_percentile({v: vs.count(v) for v in vs}, len(vs), p) "
            "for p in (0.5, 0.9, 0.99)] for vs in d['cases']]")
    theirs = locust_eval(expr, cases=cases)
    assert theirs == [[percentile(vs, p) for p in (0.5, 0.9, 0.99)] for vs in cases]


def _rec(n: int, first: float, last: float) -> Record:
    return Record(0, 0, "k", "chat", n, "ok", 0.0, t_first=first, t_last=last, output_tokens=n)


def test_tokens_in_window_splits_a_request() -> None:
    r = _rec(11, 1.0, 2.0)  # tokens at 1.0, 1.1, ..., 2.0
    assert tokens_in_window(r, 0.0, 1.0) == 0
    assert tokens_in_window(r, 0.0, 1.55) == 6
    assert tokens_in_window(r, 1.55, 10.0) == 5
    assert tokens_in_window(_rec(1, 3.0, 3.0), 2.0, 4.0) == 1
    assert tokens_in_window(_rec(0, 0, 0), 0, 9) == 0


def _sse(obj: dict | str) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj))


def test_stream_timer_ignores_empty_chunks_and_uses_usage() -> None:
    t = StreamTimer(10.0)
    t.line(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), 10.1)
    t.line(": keep-alive", 10.15)
    t.line(_sse({"choices": [{"index": 0, "delta": {"content": "a"}}]}), 10.3)
    t.line(_sse({"choices": [{"index": 0, "delta": {"content": "b"}}]}), 10.5)
    t.line(_sse({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 5}}), 10.6)
    assert t.line(_sse("[DONE]"), 10.7)
    t.finish(10.8)
    assert t.error is None and t.output_tokens == 3 and t.prompt_tokens == 5
    assert t.ttft == pytest.approx(0.3) and t.e2e == pytest.approx(0.7) and t.itl == pytest.approx(0.1)


def test_stream_timer_errors() -> None:
    t = StreamTimer(0.0)
    t.line(_sse({"choices": [{"index": 0, "text": "x"}]}), 0.1)
    assert t.line(_sse({"error": {"message": "engine died", "type": "x"}}), 0.2)
    assert "engine died" in t.error
    cut = StreamTimer(0.0)
    cut.line(_sse({"choices": [{"index": 0, "text": "x"}]}), 0.1)
    cut.finish(0.2)
    assert cut.error == "stream ended without [DONE]"
    empty = StreamTimer(0.0)
    empty.line(_sse("[DONE]"), 0.1)
    empty.finish(0.1)
    assert empty.error == "stream had no content"
    assert error_message(429, b'{"error": {"message": "over capacity"}}') == "HTTP 429: over capacity"
    assert error_message(502, b"bad gateway") == "HTTP 502: bad gateway"


def test_request_body_shapes() -> None:
    path, body = request_body("chat", "m", "hi", 7)
    assert path == "/v1/chat/completions" and body["messages"][0]["content"] == "hi"
    path, body = request_body("completions", "m", "hi", 7)
    assert path == "/v1/completions" and body["prompt"] == "hi"
    assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 7


METRICS = """# HELP moe_serve_triton_jit_compiles_total Triton compiles
# TYPE moe_serve_triton_jit_compiles_total counter
moe_serve_triton_jit_compiles_total{kernel="fused_moe",phase="warmup"} 12.0
moe_serve_triton_jit_compiles_total{kernel="fused_moe",phase="serving"} %s
moe_serve_triton_jit_compiles_total{kernel="align",phase="serving"} 1.0
"""


def test_serving_compiles_delta_and_na() -> None:
    delta = prom.compiles_delta(METRICS % "2.0", METRICS % "5.0")
    assert delta == {"total": 3.0, "per_kernel": {"fused_moe": 3.0}}
    assert prom.compiles_delta(METRICS % "2.0", METRICS % "2.0") == {"total": 0.0, "per_kernel": {}}
    assert prom.compiles_delta("other_metric 1\n", "other_metric 2\n") is None
    assert prom.compiles_delta(None, None) is None


def test_samples_read_label_values_that_hold_braces_quotes_and_escapes() -> None:
    text = ('# TYPE moe_serve_triton_jit_compiles_total counter\n'
            'moe_serve_triton_jit_compiles_total{kernel="k{1}",phase="serving",x="a \\"b\\" c"} 4.0\n'
            'moe_serve_triton_jit_compiles_created{kernel="k{1}",phase="serving",x="a \\"b\\" c"} 1.7e9\n')
    assert prom.samples(text, prom.JIT_METRIC) == [({"kernel": "k{1}", "phase": "serving", "x": 'a "b" c'}, 4.0)]
    assert prom.serving_compiles(text) == {"k{1}": 4.0}
    assert prom.samples("# TYPE moe_serve_triton_jit_compiles counter\n", prom.JIT_METRIC) == []


def _expert_body(since: float, totals: list[list[int]]) -> dict:
    return {"serving_since": since, "layers": [{"layer": i, "name": f"model.layers.{i}.mlp.experts", "experts": 4,
                                                "top_k": 2, "total": t} for i, t in enumerate(totals)]}


def test_the_runs_expert_load_is_the_difference_of_the_endpoint_reads() -> None:
    before = _expert_body(1.0, [[5, 5, 0, 0], [1, 1, 1, 1]])
    after = _expert_body(1.0, [[11, 5, 2, 0], [1, 1, 1, 1]])
    load = expert_load.run_load(before, after)
    assert load == {"restarted": False, "layers": [
        {"layer": 0, "experts": 4, "top_k": 2, "routed": 8, "tokens": 4, "imbalance": 3.0, "idle_experts": 2,
         "busiest_share": 0.75},
        {"layer": 1, "experts": 4, "top_k": 2, "routed": 0, "tokens": 0, "imbalance": None, "idle_experts": 4,
         "busiest_share": None}]}
    md = "\n".join(expert_load.markdown_lines(load))
    assert "| 0 | 4 | 2 | 4 | 3.00 | 2 | 75.0% |" in md and "| 1 | 4 | 2 | 0 | - | 4 | - |" in md
    restarted = expert_load.run_load(before, _expert_body(2.0, [[1, 1, 0, 0], [0, 0, 0, 0]]))
    assert restarted["restarted"] and restarted["layers"][0]["routed"] == 2   # counts zeroed: after's alone
    assert expert_load.run_load(None, after) is None
    assert "n/a" in expert_load.markdown_lines(None)[0]
