"""Kernel tests run on CPU under Triton's interpreter; set it before triton is imported. The
fixture `tp1`: what vLLM's layers need to be built outside an engine."""
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.append(str(Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="module")
def tp1() -> Iterator[None]:
    """A current vLLM config and a one-rank tensor-parallel group (gloo), torn down after the module."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
