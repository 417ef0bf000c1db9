"""The environment that decides what a yardstick server ran, as its run record keeps it.

Per process (meta.json "environment"): every `VLLM_*` and `MOE_SERVE_*` variable the server
process got (names holding KEY, TOKEN, SECRET or PASS left out: nothing leaks into a record; the
runtime dir, a temp path, left out), among them VLLM_PLUGINS (empty: no plugin in `vllm serve`),
the routing simulation, VLLM_TUNED_CONFIG_FOLDER and MOE_SERVE_KERNEL_CONFIG_DIR; the content of
those two folders (file -> sha256: what a table folder held when the server read it); and the
`additional_config` passed on the server's command line, if any. `shared_differences` names what
differs between processes of one run where it must not: the shared variables and folders.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_serve.kernels.plugin.plugin_metrics import RUNTIME_DIR_ENV

PREFIXES = ("VLLM_", "MOE_SERVE_")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASS", re.I)
TUNED_ENV = "VLLM_TUNED_CONFIG_FOLDER"              # vLLM's own fused-MoE tables, read before its shipped ones
KERNEL_TABLES_ENV = "MOE_SERVE_KERNEL_CONFIG_DIR"   # moe-serve's MoE tables, read before its shipped ones
ROUTING_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"
FOLDERS = (TUNED_ENV, KERNEL_TABLES_ENV)
SHARED = (TUNED_ENV, KERNEL_TABLES_ENV, ROUTING_ENV)   # the same in every server of a run
ADDITIONAL_CONFIG = ("--additional-config", "additional_config=")   # vllm serve's flag; moe-serve's --engine-arg


def decisive(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that decide what a server runs (module docstring), sorted."""
    return {k: env[k] for k in sorted(env) if k.startswith(PREFIXES) and k != RUNTIME_DIR_ENV and not SECRET.search(k)}


def folder_files(path: str) -> dict[str, str] | None:
    """{file name: sha256} of the JSON tables directly in folder `path`; None where it is no folder."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.json")) if p.is_file()}


def additional_config(argv: list[str]) -> Any:
    """The additional_config the server's argv passes (vLLM's `--additional-config JSON` or
    moe-serve's `--engine-arg additional_config=JSON`), parsed; None where none is passed."""
    for i, arg in enumerate(argv):
        if arg == ADDITIONAL_CONFIG[0] and i + 1 < len(argv):
            return json.loads(argv[i + 1])
        if arg.startswith(ADDITIONAL_CONFIG[1]):
            return json.loads(arg.removeprefix(ADDITIONAL_CONFIG[1]))
    return None


def record(extra: Mapping[str, str], argv: list[str]) -> dict[str, Any]:
    """A server's record: this process's environment with the variant's `extra` over it (what
    moe_serve.loadtest.server_proc gives the server, less the runtime dir), its folders and additional_config."""
    env = decisive({**os.environ, **extra})
    return {"env": env, "folders": {k: folder_files(env[k]) for k in FOLDERS if env.get(k)},
            "additional_config": additional_config(argv)}


def shared(rec: dict[str, Any]) -> dict[str, Any]:
    """The part of a record every server of one run must share."""
    return {"env": {k: rec["env"].get(k) for k in SHARED}, "folders": rec["folders"]}


def shared_differences(recs: dict[str, dict[str, Any]]) -> list[str]:
    """"a vs b: KEY" for each pair of processes (by name) whose shared part differs, against the first."""
    if not recs:
        return []
    (first, ref), *rest = sorted(recs.items())
    out = []
    for name, rec in rest:
        a, b = shared(ref), shared(rec)
        keys = [k for k in SHARED if a["env"][k] != b["env"][k]] + (["table folders"] if a["folders"] != b["folders"] else [])
        if keys:
            out.append(f"{name} vs {first}: {', '.join(keys)}")
    return out
