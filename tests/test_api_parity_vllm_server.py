"""The same requests (with vLLM's extension fields) to moe-serve and to vLLM's own api_server on the
same embedded model: same status class, same response structure, same greedy text; structured
outputs no slower than there. vLLM's api_server runs in this venv, where moe-serve is installed: its
plugin stays inert there, and runs our kernels only where MOE_SERVE_VLLM_PLUGIN=1 opts in."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prometheus_client.multiprocess import MultiProcessCollector

from moe_serve.kernels.plugin.plugin_metrics import RUNTIME_DIR_ENV, WORKER_INFO
from moe_serve.kernels.plugin.vllm_plugin import ENABLE_ENV
from moe_serve.loadtest.server_proc import MODEL_NAME, ServerProcess, start_server
from moe_serve.service.embedded_model import ensure_embedded_model
from moe_serve.service.engine import EMBEDDED_STRUCTURED_OUTPUTS
from tests.plugin_env import plugin_server_env

pytestmark = pytest.mark.engine
VOLATILE = {"id", "created", "system_fingerprint"}  # differ between any two responses
USER = [{"role": "user", "content": "Hello there"}]
PET = {"type": "object", "properties": {"species": {"enum": ["cat", "dog"]}, "legs": {"enum": [2, 4]}},
       "required": ["species", "legs"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "record_pet", "strict": True, "parameters": PET}}
TOOL_HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "record_pet",
                                                         "arguments": '{"species": "cat", "legs": 4}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "recorded"}]

CASES: list[tuple[str, str, dict]] = [
    ("cmpl echo+logprobs", "/v1/completions", {"prompt": "The sky is", "max_tokens": 4, "temperature": 0,
                                               "echo": True, "logprobs": 2}),
    ("cmpl sampling extensions", "/v1/completions", {
        "prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logit_bias": {"100": 5.0},
        "repetition_penalty": 1.3, "min_p": 0.05, "stop_token_ids": [2], "include_stop_str_in_output": True,
        "skip_special_tokens": False, "bad_words": ["the"], "ignore_eos": True}),
    ("cmpl prompt_logprobs+token ids", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                            "prompt_logprobs": 1, "return_token_ids": True}),
    ("cmpl choice", "/v1/completions", {"prompt": "Pick", "max_tokens": 5, "temperature": 0,
                                        "structured_outputs": {"choice": ["yes", "no"]}}),
    ("cmpl n>1 greedy", "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "temperature": 0}),
    ("cmpl long seed", "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": 2**64}),
    ("cmpl bad regex", "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[a-"}}),
    ("cmpl oov logit_bias", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"99999": 1}}),
    ("chat logprobs", "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "temperature": 0,
                                               "logprobs": True, "top_logprobs": 3}),
    ("chat json_schema", "/v1/chat/completions", {
        "messages": USER, "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}}),
    ("chat named tool", "/v1/chat/completions", {
        "messages": USER, "max_tokens": 80, "temperature": 0, "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "record_pet"}}}),
    ("chat required tool", "/v1/chat/completions", {"messages": USER, "max_tokens": 80, "temperature": 0,
                                                    "tools": [TOOL], "tool_choice": "required"}),
    ("chat tool history", "/v1/chat/completions", {"messages": TOOL_HISTORY, "max_tokens": 5, "temperature": 0,
                                                   "tools": [TOOL]}),
    ("chat echo", "/v1/chat/completions", {
        "messages": USER + [{"role": "assistant", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
        "echo": True, "add_generation_prompt": False, "continue_final_message": True}),
    ("chat tool_choice without tools", "/v1/chat/completions", {"messages": USER, "tool_choice": "required"}),
    ("tokenize chat", "/tokenize", {"messages": TOOL_HISTORY, "tools": [TOOL]}),
    ("detokenize", "/detokenize", {"tokens": [1, 22557, 1526]}),
]


def _vllm_serve(tmp: Path, opt_in: bool) -> ServerProcess:
    """vLLM's api_server, flags as moe-serve gives its frontend for the embedded model; moe-serve's
    plugin (and the test plugin, which routes vLLM-CPU's MoE calls through our hook where ours is
    active) installed, reporting into tmp/runtime; MOE_SERVE_VLLM_PLUGIN=1 only with `opt_in`."""
    env = {**plugin_server_env(cpu_moe="0" if opt_in else "1"), RUNTIME_DIR_ENV: str(tmp / "runtime"),
           ENABLE_ENV: "1" if opt_in else "0",  # "0": whatever an in-process app left in this env
           "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}  # as default_engine_env(embedded_model=True)
    return start_server(tmp, "--model", str(ensure_embedded_model()),
                        "--served-model-name", MODEL_NAME, "--kv-cache-memory-bytes", str(512 * 1024 ** 2),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--structured-outputs-config",
                        json.dumps(EMBEDDED_STRUCTURED_OUTPUTS),
                        module="vllm.entrypoints.openai.api_server", ready_timeout=400, env=env)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`vllm serve` as a user runs it beside moe-serve: no opt-in."""
    srv = _vllm_serve(Path(tmp_path_factory.mktemp("vllm-api")), opt_in=False)
    yield srv
    srv.stop()


def _shape(value: Any) -> Any:
    """The structure of a JSON value: dict keys (recursively), list item shapes, scalar types."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    return type(value).__name__ if value is not None else None


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k != "id"}  # tool-call ids are random
    return [_without_ids(v) for v in value] if isinstance(value, list) else value


def _texts(body: dict) -> list:
    outputs = [c.get("text", c.get("message")) for c in body.get("choices", [])]
    return _without_ids(outputs or [body.get("tokens"), body.get("prompt")])


@pytest.mark.parametrize("name,path,body", CASES, ids=[c[0] for c in CASES])
def test_same_status_structure_and_greedy_text(server: ServerProcess, vllm_server: ServerProcess, name: str,
                                               path: str, body: dict) -> None:
    ours = httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, headers=server.headers, timeout=120)
    theirs = httpx.post(vllm_server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=120)
    assert ours.status_code // 100 == theirs.status_code // 100, (ours.text[:300], theirs.text[:300])
    a, b = ours.json(), theirs.json()
    if theirs.status_code >= 400:
        assert set(a["error"]) == set(b["error"]) == {"message", "type", "param", "code"}
        return
    assert _shape(a) == _shape(b)
    assert _texts(a) == _texts(b)  # greedy (temperature 0) or deterministic (tokenize): the same output


def _stream(url: str, headers: dict, body: dict) -> tuple[str, list]:
    text, shapes = "", []
    with httpx.stream("POST", url + "/v1/chat/completions", json={"model": MODEL_NAME, "stream": True, **body},
                      headers=headers, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                shapes.append(_shape(event))
                text += "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
    return text, shapes


def test_same_stream_with_continuous_usage(server: ServerProcess, vllm_server: ServerProcess) -> None:
    body = {"messages": USER, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ours = _stream(server.base_url, server.headers, body)
    theirs = _stream(vllm_server.base_url, {}, body)
    assert ours == theirs and ours[1]  # events came (their text may be empty: greedy EOS on some CPUs)


def test_same_model_card_fields(server: ServerProcess, vllm_server: ServerProcess) -> None:
    ours = httpx.get(server.base_url + "/v1/models", headers=server.headers).json()
    theirs = httpx.get(vllm_server.base_url + "/v1/models").json()
    assert _shape(ours) == _shape(theirs)
    assert ours["data"][0]["root"] == MODEL_NAME  # vLLM says the model's path here; we never do


def _worker_info(runtime: Path) -> list[dict[str, str]]:
    """The moe_serve_vllm_worker_info series the plugin of a vLLM worker wrote into `runtime`."""
    files = [str(f) for f in runtime.glob("*.db")] if runtime.is_dir() else []
    return [dict(sample.labels) for fam in MultiProcessCollector.merge(files, accumulate=True)
            if fam.name == WORKER_INFO for sample in fam.samples if sample.value]


def test_vllm_serve_beside_moe_serve_runs_vllms_own_moe_path(vllm_server: ServerProcess) -> None:
    """No opt-in: the plugin patched nothing in any process of `vllm serve` (no hook, no worker
    report, no MoE call through our hook though the test plugin asks for it), and served."""
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
    assert httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=120).status_code == 200
    assert _worker_info(Path(vllm_server.log_path).parent / "runtime") == []
    assert "moe-serve plugin loaded" not in vllm_server.log()


def test_vllm_serve_runs_our_kernels_with_the_opt_in(tmp_path: Path) -> None:
    """MOE_SERVE_VLLM_PLUGIN=1: vLLM's own api_server loads our hooks in its worker (mode optimized,
    MoE hook installed) and serves."""
    srv = _vllm_serve(tmp_path, opt_in=True)
    try:
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120).status_code == 200
        workers = _worker_info(tmp_path / "runtime")
        log = srv.log()
    finally:
        srv.stop()
    assert [(w["mode"], w["moe_hook"], w["phase"]) for w in workers] == [("optimized", "installed", "serving")], workers
    assert "moe-serve plugin loaded" in log and "TritonExperts.apply" in log


def _pattern_schema(n: int, prefix: str) -> dict:
    """The issue's pattern-heavy family: n string properties, each `[a-z]{2,30}[0-9]{1,5}`."""
    names = [f"{prefix}{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "string", "pattern": "[a-z]{2,30}[0-9]{1,5}"} for k in names},
            "required": names}


def _timed(url: str, headers: dict, schema: dict) -> float:
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    began = time.perf_counter()
    resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text[:300]
    return time.perf_counter() - began


@pytest.mark.parametrize("n", [10, 100, 500])
def test_pattern_heavy_schemas_are_served_about_as_fast_as_vllm_serve(server: ServerProcess,
                                                                      vllm_server: ServerProcess, n: int) -> None:
    """Each schema new to both servers (no verdict or grammar cached), the same one to each, in
    alternating order: every one is accepted, and the median latency is within 1.5x of vLLM's."""
    ours, theirs = [], []
    for round_ in range(5):
        schema = _pattern_schema(n, f"k{uuid.uuid4().hex[:6]}_")
        pair = [(ours, server.base_url, server.headers), (theirs, vllm_server.base_url, {})]
        for times, url, headers in pair[::1 if round_ % 2 == 0 else -1]:
            times.append(_timed(url, headers, schema))
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"N = {n}: moe-serve {statistics.median(ours):.3f} s, vllm serve {statistics.median(theirs):.3f} s, "
          f"ratio {ratio:.2f}")
    assert ratio <= 1.5, (ours, theirs)
