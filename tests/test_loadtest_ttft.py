"""The TTFT the load test records is the time to the first *content* chunk.

A stub OpenAI server (a few lines of ASGI under uvicorn, in its own process) sends an empty role
chunk at once, waits FIRST_DELAY_S, then streams `max_tokens` chunks GAP_S apart.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from moe_serve.loadtest.runner import Target, run
from moe_serve.loadtest.scenarios import Options
from moe_serve.loadtest.server_proc import REPO, free_port

FIRST_DELAY_S = 0.3
GAP_S = 0.05
MAX_TOKENS = 8


def _chunk(content: str, role: bool = False) -> bytes:
    delta = {"role": "assistant", "content": content} if role else {"content": content}
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'text': content}]})}\n\n".encode()


async def stub_app(scope, receive, send) -> None:
    """Streams like an OpenAI server (chat and completions alike); anything else is 404."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if not scope["path"].startswith("/v1/"):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"not found"})
        return
    n = json.loads(body)["max_tokens"]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": _chunk("", role=True), "more_body": True})
    await asyncio.sleep(FIRST_DELAY_S)
    for i in range(n):
        if i:
            await asyncio.sleep(GAP_S)
        await send({"type": "http.response.body", "body": _chunk(f"t{i} "), "more_body": True})
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
    await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})


@pytest.fixture(scope="module")
def stub_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("stub") / "stub.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.test_loadtest_ttft:stub_app", "--port",
                             str(port), "--log-level", "warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("stub server did not start")
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.mark.parametrize("engine", ["locust", "asyncio"])
def test_ttft_is_time_to_first_content_chunk(stub_url: str, engine: str, tmp_path: Path) -> None:
    opts = Options(max_users=2, step_seconds=2.0, max_tokens=MAX_TOKENS, prompt_words=4)
    report = run("step", opts, Target(stub_url, "stub"), tmp_path, engine=engine, plots=False)
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    ok = [r for r in records if r["status"] == "ok"]
    assert len(ok) >= 4 and not [r for r in records if r["status"] == "error"]
    decode_s = (MAX_TOKENS - 1) * GAP_S
    for r in ok:
        # after the role chunk (t=0), before the middle of the content: the first content chunk.
        # Upper bounds leave room for a shared 2-core CI machine stalling the client.
        assert FIRST_DELAY_S <= r["ttft"] < FIRST_DELAY_S + decode_s / 2, r
        # the first chunk may land late (shrinking the mean gap); a shared CI core may stretch it
        assert 0.5 * GAP_S <= r["itl"] < 3 * GAP_S, r
        assert FIRST_DELAY_S + decode_s <= r["e2e"] < FIRST_DELAY_S + decode_s + 0.5, r
        assert r["output_tokens"] == MAX_TOKENS
    for stage in report["stages"]:
        assert FIRST_DELAY_S * 1000 <= stage["ttft_p50_ms"] < (FIRST_DELAY_S + decode_s / 2) * 1000
    assert report["serving_jit_compiles"] is None  # the stub has no /metrics: "n/a"
