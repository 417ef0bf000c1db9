"""The generated tables of bench/RESULTS.md and README.md match the committed raw files
(`moe-serve bench tables --check`), and the evidence stays what RESULTS.md promises: compact,
named by what it measures, every claim folder used."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve.bench import cli, tables

REPO = Path(__file__).resolve().parents[1]


def test_every_document_matches_its_raw_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert tables.main(["--check"]) == 0, capsys.readouterr().out[-4000:]
    assert "RESULTS.md, README.md: " in capsys.readouterr().out


def test_without_the_bench_extra_tables_says_in_one_line_which_extra(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The README's venv (cpu, loadtest extras) has no scipy: --check names the extra, no traceback."""
    monkeypatch.setitem(sys.modules, "scipy", None)
    assert cli.main(["tables", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs scipy" in err and "'.[bench]'" in err, err
    assert "the bench extra" in cli.COMMANDS["tables"][1]       # --help says so too


@pytest.mark.parametrize("command", ["serve", "tables"])
def test_a_subcommand_whose_import_needs_the_bench_extra_says_so(command: str) -> None:
    """A fresh interpreter without psutil (imported by the yardstick's server module): one line."""
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['psutil'] = None; from moe_serve.bench.cli import "
                          f"main; sys.exit(main(['{command}', '--help']))"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.count("\n") == 1 and f"bench {command}: needs psutil" in run.stderr, run.stderr


def test_a_missing_module_of_no_extra_is_not_dressed_up() -> None:
    assert cli.missing_extra("tables", ModuleNotFoundError(name="no_such_module")) is None
    assert "'.[cpu]' (CPU) or '.[gpu]'" in cli.missing_extra("kernels", ModuleNotFoundError(name="triton.language"))


def test_an_edited_number_in_a_block_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = []
    for doc in tables.DOCS:
        text = doc.read_text()
        cell = "**1.128 [1.126, 1.130]** (3 + 3)"                    # the H100 Qwen3 c = 1 row in both
        assert cell in text
        copy = tmp_path / doc.name
        copy.write_text(text.replace(cell, "**1.250 [1.236, 1.263]** (3 + 3)"))
        docs.append(str(copy))
    assert tables.main(["--check", *docs]) == 1
    out = capsys.readouterr()
    assert "-| qwen3-30b-a3b | bf16 | NVIDIA H100" in out.out and "+| qwen3-30b-a3b | bf16 | NVIDIA H100" in out.out
    assert "RESULTS.md differs" in out.err and "README.md differs" in out.err


def test_every_block_is_registered_and_every_entry_used() -> None:
    texts = {d: d.read_text() for d in tables.DOCS}
    with pytest.raises(KeyError, match="nope"):
        tables.render({**texts, Path("x.md"): "<!-- results_tables: nope -->\nx\n<!-- /results_tables -->\n"})
    results = tables.DOCS[0]
    text = texts[results]
    start = text.index("<!-- results_tables: kernels-fp8-formats -->")
    end = text.index("<!-- /results_tables -->", start) + len("<!-- /results_tables -->")
    with pytest.raises(KeyError, match="kernels-fp8-formats"):
        tables.render({**texts, results: text[:start] + text[end:]})


def test_the_first_screen_of_results_and_readme_is_the_headline_table() -> None:
    results = tables.DOCS[0].read_text()
    assert re.findall(r"<!-- results_tables: ([\w-]+) -->", results)[0] == "headline"
    assert results.index("<!-- results_tables: headline -->") < 400          # after one sentence
    readme = (REPO / "README.md").read_text()
    first = readme[:readme.index("## Talking to it")]
    assert re.findall(r"<!-- results_tables: ([\w-]+) -->", first) == ["headline", "headline-prose"]


def test_every_claim_folder_backs_a_table_and_the_evidence_is_compact() -> None:
    claims = {p.name for p in tables.RESULTS.iterdir() if p.is_dir()}
    source = (REPO / "bench" / "tables.py").read_text()
    assert claims and all(f'"{c}"' in source for c in claims), claims
    size = sum(p.stat().st_size for p in tables.RESULTS.rglob("*") if p.is_file())
    assert size < 5 * 1024 ** 2, size


def test_no_tracked_path_or_text_is_named_by_a_run_counter() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert not re.findall(r"(?i)session_?\d+", tracked)
    texts = [p for p in tracked.splitlines() if p.endswith((".py", ".md", ".sh", ".toml", ".yml", ".json"))
             and not p.endswith(".jsonl.xz")]
    named = [p for p in texts if re.search(r"(?i)\bsession_?\d+\b|\bs\d\d_serve|session\d+_", (REPO / p).read_text(errors="replace"))]
    assert named == []
