"""--dense-gemv in a real server (the session's strict server on vLLM's CPU engine): the worker's
plugin wraps vLLM's unquantized linear and lm_head methods, the model compiles with the wrapper
traced into it (on CPU it keeps vLLM's GEMM: our op serves CUDA tensors only) and serves, and
/version reports the switch."""
from __future__ import annotations

import httpx

from moe_serve.loadtest.server_proc import ServerProcess


def test_a_server_with_the_dense_gemv_hook_serves(strict_server: ServerProcess) -> None:
    with httpx.Client(base_url=strict_server.base_url, headers=strict_server.headers, timeout=120) as http:
        assert http.get("/version").json()["dense_gemv"] is True
        model = http.get("/v1/models").json()["data"][0]["id"]
        resp = http.post("/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    loaded = [line for line in strict_server.log().splitlines() if "moe-serve plugin: worker hooks" in line
              and "'UnquantizedLinearMethod.apply', 'UnquantizedEmbeddingMethod.apply'" in line]
    assert loaded, "no worker installed the dense GEMV hook"
