"""The yardstick's source digest (bench/serve/provenance.py): the tree on disk against the commit's
blobs in a real git repository, and `moe-serve bench serve verify` over recorded meta.json files."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from moe_serve.bench.serve import provenance, run_env
from moe_serve.bench.serve.yardstick import main as yardstick_main


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture()
def repo(tmp_path: Path) -> tuple[Path, str]:
    files = {"pyproject.toml": "[project]\nname = 'x'\n", "service/app.py": "A = 1\n",
             "kernels/moe/configs/t.json": "{}\n", "bench/serve/load.py": "B = 2\n",
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
