"""bench/flashinfer_aot.py's aborting stubs: a shared library whose TensorRT-LLM symbol is left
out links, loads with every symbol resolved, and stops loudly when the stub is called."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import flashinfer_aot  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("nm") is None,
                                reason="needs gcc and nm")
SYM = "_ZN12tensorrt_llm7kernels8left_outEv"   # tensorrt_llm::kernels::left_out()


def _lib(tmp_path: Path, extra: list[Path]) -> Path:
    src = tmp_path / "user.c"
    src.write_text(f"extern void {SYM}(void);\nint call_left_out(void) {{ {SYM}(); return 1; }}\n"
                   "int answer(void) { return 42; }\n")
    so = tmp_path / "libuser.so"
    subprocess.check_call(["gcc", "-shared", "-fPIC", str(src), *map(str, extra), "-o", str(so)])
    return so


def test_left_out_symbols_are_found_then_stubbed(tmp_path):
    so = _lib(tmp_path, [])
    assert flashinfer_aot._undefined_trtllm(so) == [SYM]
    so = _lib(tmp_path, [flashinfer_aot._stub_object([SYM], tmp_path)])
    assert flashinfer_aot._undefined_trtllm(so) == []
    assert ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL | 2).answer() == 42   # RTLD_NOW binds all


def test_calling_a_stub_aborts_with_its_message(tmp_path):
    so = _lib(tmp_path, [flashinfer_aot._stub_object([SYM], tmp_path)])
    proc = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(so)!r}).call_left_out()"],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "left-out FlashInfer tactic was called" in proc.stderr
