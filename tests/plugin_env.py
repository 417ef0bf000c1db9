"""Server env that loads the test-only vLLM plugin (tests/vllm_test_plugin) in every process."""
from __future__ import annotations

import os
from pathlib import Path

TEST_PLUGIN_DIR = Path(__file__).resolve().with_name("vllm_test_plugin")


def plugin_server_env(**switches: str) -> dict[str, str]:
    """start_server env: the test plugin on PYTHONPATH and its switches (probe_kernel="1" ->
    MOE_SERVE_TEST_PROBE_KERNEL=1; see the plugin's docstring)."""
    path = os.pathsep.join(p for p in (str(TEST_PLUGIN_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, **{f"MOE_SERVE_TEST_{k.upper()}": v for k, v in switches.items()}}
