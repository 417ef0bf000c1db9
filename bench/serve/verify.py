"""`moe-serve bench serve verify DIR [DIR...]`: may each yardstick process be published?

Per process (a DIR/<variant>/r<round>/ with meta.json and its `complete` marker):

- source: the digest of the source it ran is its named commit's (provenance.verdict "clean");
- dirty: it did not run from a tree with uncommitted changes (true refuses it);
- versions: GPU, vLLM, torch and Triton recorded, and the driver on a GPU;
- environment: recorded (run_env.py), with `vllm serve`'s VLLM_PLUGINS empty (no plugin);
- vLLM's MoE table: recorded (baseline_table.expected), a tuned one's sha256 as its folder held
  it, and where the variant runs vLLM's kernel at every size, its server log saying it loaded that
  file, or ran its default where none was found (baseline_table.disagreement; the log read from
  server.log or server.log.xz where kept, else the lines the run kept in meta.json);
- requests: at every level the timed requests the run planned, every one answered.

Per run (the processes of one DIR): the environment every server must share and vLLM's MoE table
are the same in every process; the processes per variant are counted (a headline cell needs
3 + 3, 4 + 4 where its interval is wider than 2 %: the tables say n/a otherwise). Prints one line
per process and per run; exit 1 where a check fails, 2 where DIR holds no process.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from moe_serve.bench.serve import baseline_table, provenance, run_env
from moe_serve.bench.serve.servers import BASELINE, FRONTEND, VLLM_TRITON
from moe_serve.bench.serve.stats import COMPLETE, read_records

VLLM_KERNEL_VARIANTS = (BASELINE, VLLM_TRITON, FRONTEND)   # vLLM's MoE kernel at every batch size
VERSIONS = ("gpu", "vllm", "torch", "triton")


def table_problems(d: Path, meta: dict[str, Any]) -> list[str]:
    """What is wrong with the process's record of vLLM's MoE table (module docstring)."""
    table = meta.get("vllm_moe_table")
    if table is None:
        return ["no vLLM MoE table recorded"]
    out = []
    folder = ((meta.get("environment") or {}).get("folders") or {}).get(run_env.TUNED_ENV) or {}
    for t in table["tables"]:
        if t["source"] == "tuned" and folder.get(t["file"]) != t["sha256"]:
            out.append(f"{t['file']}: its sha256 is not the one its folder held")
    if meta["variant"] in VLLM_KERNEL_VARIANTS:
        seen = baseline_table.seen_by(d, meta)
        if seen is None:
            out.append("no server log and no logged MoE table lines kept")
        elif why := baseline_table.disagreement(table, seen, meta.get("gpu", ""),
                                                (meta.get("backends") or {}).get("moe")):
            out.append(why)
    return out


def request_problems(d: Path, meta: dict[str, Any]) -> list[str]:
    """Levels whose timed requests are fewer than planned, or not all answered."""
    planned = meta.get("requests_per_level") or {}
    measured = [r for r in read_records(d) if r.get("phase") == "measured"]
    out = []
    for c in meta["workload"]["levels"]:
        at = [r for r in measured if r["level"] == c]
        ok = sum(r["status"] == "ok" for r in at)
        if str(c) not in planned or ok != planned[str(c)] or ok != len(at):
            out.append(f"c = {c}: {ok} of {len(at)} timed requests answered, {planned.get(str(c), '?')} planned")
    return out


def problems(d: Path, meta: dict[str, Any], cache: dict[str, tuple[str | None, ...]]) -> list[str]:
    """Every check of one process that fails (module docstring), as reasons."""
    out = []
    source = provenance.verdict(meta, cache=cache)
    if source != "clean":
        out.append(f"source: {source}")
    if meta.get("dirty") is True:
        out.append("dirty: ran from a tree with uncommitted changes")
    missing = [k for k in VERSIONS if not meta.get(k)] + (["driver"] if meta.get("gpu") not in (None, baseline_table.CPU)
                                                          and not meta.get("driver") else [])
    if missing:
        out.append(f"not recorded: {', '.join(missing)}")
    env = meta.get("environment")
    if env is None:
        out.append("no environment recorded")
    elif meta["variant"] in (BASELINE, VLLM_TRITON) and env["env"].get("VLLM_PLUGINS") != "":
        out.append(f"`vllm serve` ran with VLLM_PLUGINS={env['env'].get('VLLM_PLUGINS')!r}")
    return out + table_problems(d, meta) + request_problems(d, meta)


def run_problems(metas: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between the processes of one run where it must not."""
    envs = {name: m["environment"] for name, m in metas.items() if m.get("environment")}
    out = run_env.shared_differences(envs) if envs else ["no process recorded its environment"]
    tables = {json.dumps(m.get("vllm_moe_table"), sort_keys=True) for m in metas.values()}
    if len(tables) > 1:
        out.append(f"{len(tables)} different vLLM MoE table records")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe-serve bench serve verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path, help="yardstick output or claim folders")
    a = p.parse_args(argv)
    cache: dict[str, tuple[str | None, ...]] = {}
    procs = sorted(m.parent for d in a.dirs for m in d.rglob("meta.json") if (m.parent / COMPLETE).is_file())
    if not procs:
        print(f"no complete yardstick process under {', '.join(map(str, a.dirs))}")
        return 2
    runs: dict[Path, dict[str, dict[str, Any]]] = {}
    bad = 0
    for d in procs:
        meta = json.loads((d / "meta.json").read_text())
        runs.setdefault(d.parent.parent, {})[f"{d.parent.name}/{d.name}"] = meta
        why = problems(d, meta, cache)
        bad += bool(why)
        print(f"{d}: {(meta.get('commit') or 'no commit')[:10]} " + ("FAILED: " + "; ".join(why) if why else "OK"))
    for run, metas in sorted(runs.items()):
        why = run_problems(metas)
        bad += bool(why)
        count = Counter(m["variant"] for m in metas.values())
        print(f"{run}: processes " + ", ".join(f"{v} {n}" for v, n in sorted(count.items()))
              + (f"; FAILED: {'; '.join(why)}" if why else "; shared environment and MoE table OK"))
    print(f"{len(procs)} processes: " + (f"{bad} checks failed" if bad else "every check passed"))
    return 1 if bad else 0
