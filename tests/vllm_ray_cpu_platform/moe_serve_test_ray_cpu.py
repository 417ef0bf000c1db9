"""Test-only vLLM platform plugin: vLLM's CPU platform, made to run under vLLM's Ray executor.

Never installed: tests/test_ray_executor.py puts this directory on the PYTHONPATH of its Ray head
(so of every Ray worker) and of its server, and vLLM finds the entry point in the dist-info
beside this file. vLLM's CPU platform has no Ray device key, and its Ray executor stops with
"current platform cpu does not support ray." The executor places one worker per unit of the
platform's Ray resource; here that is "GPU", which the test's Ray head declares (--num-gpus 2)
as a stand-in for two GPUs: everything else (Ray actors, vLLM's worker start and general plugin
loading in them, collective_rpc, the CPU engine itself) is vLLM's and Ray's own code.
Active only where vLLM would pick its CPU platform.
"""
from __future__ import annotations

from vllm.platforms import cpu_platform_plugin
from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):
    ray_device_key = "GPU"


def activate() -> str | None:
    """vLLM platform-plugin entry point: this platform's qualified name on a CPU host, else None."""
    return f"{__name__}.RayCpuPlatform" if cpu_platform_plugin() else None
