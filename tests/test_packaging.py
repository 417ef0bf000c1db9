"""Packaging facts that break users silently if they regress."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_console_script_points_at_a_callable() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["moe-serve"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert installed.get("moe-serve") == scripts["moe-serve"]


def test_dockerfile_copies_existing_paths_and_runs_the_console_script() -> None:
    text = (REPO / "Dockerfile").read_text()
    sources = [src for line in text.splitlines() if line.startswith("COPY ")
               for src in line.split()[1:-1] if not src.startswith("--")]
    assert sources, "no COPY lines found"
    for src in sources:
        assert (REPO / src).exists(), f"Dockerfile COPYs missing path {src}"
    entrypoints = re.findall(r'^ENTRYPOINT \["([^"]+)"', text, flags=re.M)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoints and all(e in scripts for e in entrypoints)
    assert re.findall(r"^FROM \S+ AS (\w+)", text, flags=re.M) == ["cpu", "gpu"]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    test_line = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("bash "))
    command = test_line.split("#")[0].strip()
    assert command in (REPO / ".ci" / "run").read_text()


def test_kernel_plugin_entry_point_is_installed() -> None:
    from moe_serve.service.engine import kernel_plugin_installed

    assert kernel_plugin_installed()


def test_optimized_mode_refuses_to_start_without_the_plugin(monkeypatch, capsys) -> None:
    """From a bare source tree vLLM would silently run its own kernels: refuse with a clear error."""
    import moe_serve.service.engine
    from moe_serve.service import cli

    monkeypatch.setattr(moe_serve.service.engine, "kernel_plugin_installed", lambda: False)
    assert cli.main(["--moe-kernels", "optimized", "--model", "/nonexistent"]) == 2
    assert "vllm.general_plugins" in capsys.readouterr().err


def test_license_is_an_spdx_string_with_its_file() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert all((REPO / name).is_file() for name in project["license-files"])
    assert "Apache License" in (REPO / "LICENSE").read_text()


def test_gpu_extra_accepts_exactly_the_vllm_versions_whose_pins_are_checked() -> None:
    from packaging.requirements import Requirement

    from moe_serve.kernels.plugin.vllm_compat import SUPPORTED

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (vllm,) = [Requirement(r) for r in extras["gpu"]]
    assert vllm.name == "vllm"
    minors = {minor for minor in range(20, 40) if f"0.{minor}.0" in vllm.specifier}
    assert minors == {minor for _, minor in SUPPORTED} == {26, 32, 33}
    assert "0.26.3" in vllm.specifier and "0.32.1" in vllm.specifier and "0.33.0" in vllm.specifier


def test_without_an_engine_the_import_error_names_the_extras() -> None:
    code = "import sys; sys.modules['vllm'] = None; import moe_serve.service.vllm_compat"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: moe-serve needs an inference engine"), last
    assert "moe-serve[cpu]" in last and "moe-serve[gpu]" in last


def test_every_readme_request_example_bounds_its_output() -> None:
    """A random-weight model rarely stops by itself: an example without a cap streams thousands of tokens."""
    readme = (REPO / "README.md").read_text()
    bodies = re.findall(r"-d '(\{.*?\})'", readme)
    calls = re.findall(r"\.create\((.*?)\)(?:\.|\n|:)", readme, flags=re.S)
    assert len(bodies) >= 3 and len(calls) >= 3
    caps = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for body in bodies:
        assert any(cap in json.loads(body) for cap in caps), body
    for call in calls:
        assert any(f"{cap}=" in call for cap in caps), call
    assert "405" in readme and "/health" in readme and "until curl" in readme
