"""The yardstick's source digest (bench/serve/provenance.py): the tree on disk against the commit's
blobs in a real git repository, and `moe-serve bench serve verify` over recorded meta.json files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve.bench.serve import provenance, run_env
from moe_serve.bench.serve.yardstick import main as yardstick_main


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


PYPROJECT = """[project]
name = 'x'
[tool.setuptools.package-dir]
"moe_serve.kernels" = "kernels"
"moe_serve.service" = "service"
"moe_serve.bench" = "bench"
[tool.setuptools.package-data]
"moe_serve.kernels.moe" = ["configs/*.json"]
"""


@pytest.fixture()
def repo(tmp_path: Path) -> tuple[Path, str]:
    files = {"pyproject.toml": PYPROJECT, "service/app.py": "A = 1\n", "service/setup.sh": "echo\n",
             "kernels/moe/configs/t.json": "{}\n", "kernels/moe/notes.json": "{}\n", "bench/serve/load.py": "B = 2\n",
             "bench/results/run/meta.json": "{}\n", "README.md": "text\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return tmp_path, _git(tmp_path, "rev-parse", "HEAD")


def test_a_clean_tree_has_its_commits_digest_and_only_source_changes_count(repo: tuple[Path, str]) -> None:
    root, head = repo
    clean = provenance.source_digest(root)
    assert provenance.digest_at(head, root) == clean
    (root / "bench/results/run/meta.json").write_text('{"new": 1}\n')      # evidence: not source
    (root / "README.md").write_text("edited\n")                             # outside SOURCE
    (root / "service/__pycache__").mkdir()
    (root / "service/__pycache__/app.cpython-311.pyc").write_bytes(b"\0")
    assert provenance.source_digest(root) == clean
    (root / "service/app.py").write_text("A = 2\n")
    assert provenance.source_digest(root) != clean
    (root / "service/app.py").write_text("A = 1\n")
    (root / "kernels/moe/configs/new.json").write_text("{}\n")               # an untracked table counts
    assert provenance.source_digest(root) != clean


def test_an_installed_package_digests_what_pip_installs_and_is_clean_for_its_commit(repo: tuple[Path, str],
                                                                                   tmp_path: Path) -> None:
    """The installed layout (the folders under moe_serve/, without pyproject.toml, setup scripts or
    JSON outside package-data) has its own digest, and verdict takes it as the commit's."""
    root, head = repo
    keep = provenance.installed_selection(PYPROJECT)
    assert [keep(r) for r in ("service/app.py", "kernels/moe/configs/t.json", "service/setup.sh",
                              "kernels/moe/notes.json", "kernels/moe/configs/deep/t.json", "README.md")] == \
        [True, True, False, False, False, False]
    package = tmp_path / "site" / "moe_serve"
    for rel in ("service/app.py", "kernels/moe/configs/t.json", "bench/serve/load.py"):
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_bytes((root / rel).read_bytes())
    installed = provenance.source_digest(package)
    assert installed == provenance.source_digest(root, installed=True) == provenance.digest_at(head, root, installed=True)
    assert installed != provenance.source_digest(root)
    assert provenance.verdict({"commit": head, "source_sha256": installed}, root) == "clean"
    (package / "service/app.py").write_text("A = 2\n")
    assert provenance.verdict({"commit": head, "source_sha256": provenance.source_digest(package)}, root) == "differs"


def test_pip_install_of_this_checkout_digests_as_its_installed_selection(tmp_path: Path) -> None:
    """The real package: `pip install --target` of this checkout, digested where it landed, equals
    the checkout's files that pyproject.toml says pip installs."""
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(tmp_path), str(provenance.ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert provenance.source_digest(tmp_path / "moe_serve") == provenance.source_digest(installed=True)


def test_verdicts(repo: tuple[Path, str]) -> None:
    root, head = repo
    digest = provenance.source_digest(root)
    assert provenance.verdict({"commit": head, "source_sha256": digest}, root) == "clean"
    assert provenance.verdict({"commit": head[:7], "source_sha256": digest}, root) == "clean"
    assert provenance.verdict({"commit": head, "source_sha256": "0" * 64}, root) == "differs"
    assert provenance.verdict({"commit": head}, root) == "no digest recorded"
    assert provenance.verdict({"commit": "f" * 40, "source_sha256": digest}, root) == "commit not in this clone"


def test_verify_command_exits_1_where_a_process_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """verify recomputes the named commit's digest from git: the process that ran it passes, one
    whose digest differs fails, and an empty folder is no run at all."""
    try:
        head = _git(provenance.ROOT, "rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("this checkout is not a git repository")
    at_head = provenance.digest_at(head)
    if at_head is None:
        pytest.skip("this checkout has no git history")
    env = run_env.record({"VLLM_PLUGINS": ""}, [])
    for name, digest in (("a", at_head), ("b", "0" * 64)):
        d = tmp_path / name / "vllm-serve" / "r0"
        d.mkdir(parents=True)
        meta = {"variant": "vllm-serve", "commit": head, "source_sha256": digest, "dirty": False, "gpu": "cpu",
                "vllm": "0.32.0", "torch": "2.13.0", "triton": "3.9.0", "environment": env,
                "vllm_moe_table": {"device_name": "cpu", "tables": []}, "backends": {"moe": "CPU"},
                "workload": {"levels": [1]}, "requests_per_level": {"1": 1}}
        (d / "meta.json").write_text(json.dumps(meta))
        (d / "requests.jsonl").write_text(json.dumps({"level": 1, "phase": "measured", "status": "ok"}))
        (d / "server.log").write_text("")
        (d / "complete").write_text("{}")
    assert yardstick_main(["verify", str(tmp_path / "a")]) == 0
    assert f"{head[:10]} OK" in capsys.readouterr().out
    assert yardstick_main(["verify", str(tmp_path)]) == 1
    assert "FAILED: source: differs" in capsys.readouterr().out
    assert yardstick_main(["verify", str(tmp_path / "nothing")]) == 2
