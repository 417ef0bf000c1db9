"""HISTORY.md renderers for the FP8-backend proof: the three-way kernel table, the decode A/B
intervals and process times, the MoE share of a decode step and the tuner's two-phase times."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from statistics import geometric_mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_profile  # noqa: E402
import decode_stats  # noqa: E402

BACKENDS = ("flashinfer_cutlass", "vllm_triton", "ours")


def _us(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "n/a"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b is not None else "n/a"


def fp8_backends(path: Path) -> list[str]:
    """Per shard and M: us of each backend, the served time and the ratios to FlashInfer."""
    res = json.loads(path.read_text())
    out = [f"device {res['meta']['device']}, FlashInfer {res['meta']['flashinfer']}, vLLM "
           f"{res['meta']['vllm']}; us per MoE layer call (CUDA-graph replay, median)", "",
           "| shard | M | FlashInfer CUTLASS | vLLM Triton | ours | served (route) | FI / vLLM Triton | "
           "FI / served | max rel err (FI, vLLM, ours) |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        fi, vt, served = r.get("flashinfer_cutlass_us"), r.get("vllm_triton_us"), r.get("served_us")
        errs = ", ".join(f"{r[b + '_err']:.3f}" if b + "_err" in r else "n/a" for b in BACKENDS)
        out.append(f"| {r['shape']} | {r['M']} | {_us(fi)} | {_us(vt)} | {_us(r.get('ours_us'))} | "
                   f"{_us(served)} ({r['route']}) | {_ratio(fi, vt)} | {_ratio(fi, served)} | {errs} |")
    out += ["", "| shard | geomean M<=64: FI / vLLM Triton | FI / served | served / vLLM Triton |",
            "|---|---:|---:|---:|"]
    for shape in dict.fromkeys(r["shape"] for r in res["rows"]):
        rows = [r for r in res["rows"] if r["shape"] == shape and r["M"] <= 64
                and all(r.get(k) for k in ("flashinfer_cutlass_us", "vllm_triton_us", "served_us"))]
        if rows:
            g = (lambda a, b: geometric_mean([r[a] / r[b] for r in rows]))
            out.append(f"| {shape} | {g('flashinfer_cutlass_us', 'vllm_triton_us'):.2f}x | "
                       f"{g('flashinfer_cutlass_us', 'served_us'):.2f}x | "
                       f"{g('vllm_triton_us', 'served_us'):.2f}x |")
    return out


def fp8_backends_l2(path: Path) -> list[str]:
    """Per shard and M: each backend's us with L2 warm (the replayed calls share one set of
    weights) and with L2 flushed before every call, and the served time against FlashInfer both ways."""
    res = json.loads(path.read_text())
    names = {"flashinfer_cutlass": "FI", "vllm_triton": "vLLM Triton", "served": "served"}
    out = [f"device {res['meta']['device']}, FlashInfer {res['meta']['flashinfer']}, vLLM "
           f"{res['meta']['vllm']}; us per MoE layer call (CUDA-graph replay, median), warm / L2 flushed", "",
           "| shard | M | " + " | ".join(f"{n} warm | {n} flushed" for n in names.values())
           + " | FI / served warm | FI / served flushed |", "|---|---|" + "---:|" * (2 * len(names) + 2)]
    for r in res["rows"]:
        cells = [_us(r.get(b + t)) for b in names for t in ("_us", "_l2cold_us")]
        out.append(f"| {r['shape']} | {r['M']} | " + " | ".join(cells) + " | "
                   + f"{_ratio(r.get('flashinfer_cutlass_us'), r.get('served_us'))} | "
                   + f"{_ratio(r.get('flashinfer_cutlass_l2cold_us'), r.get('served_l2cold_us'))} |")
    return out


def decode_profile_table(*dirs: Path) -> list[str]:
    """Per profiled probe process and B: the measured step split into GPU busy, MoE kernels,
    other kernels and GPU waiting (bench/decode_profile.py)."""
    return decode_profile.table(decode_stats.load_runs(list(dirs)))


def decode_ab(baseline: str, *dirs: Path) -> list[str]:
    """The decode A/B table (bench/decode_stats.py) and, per variant, the MoE backend vLLM logged."""
    runs = decode_stats.load_runs(list(dirs))
    out = decode_stats.markdown(decode_stats.summarize(runs, baseline), baseline)
    picked: dict[str, set[str]] = {}
    for r in runs:
        picked.setdefault(r["variant"], set()).update(
            re.sub(r"^.*?(Using|using)", r"\1", ln).strip() for ln in r.get("moe_backend_log", []))
    out += ["", "MoE backend lines in the engine logs, per variant:"]
    out += [f"- {v}: {'; '.join(sorted(p)) or 'none logged'}" for v, p in sorted(picked.items())]
    return out


_CLOCK = r"(\d\d:\d\d:\d\d)"
_PHASES = (("engine args", _CLOCK + r" \[api_utils\.py:\d+\] non-default args", 0),  # (name, line, which)
           ("engine core's first line", _CLOCK + r" \[core\.py:\d+\] Initializing", 0),
           ("engine up", r"\[probe " + _CLOCK + r"\] engine up", 0),
           ("last B measured", r"\[probe " + _CLOCK + r"\] B=", -1))


def _phase_s(run: dict, log: Path) -> list[float] | None:
    """Seconds from process start to each of _PHASES, from the log's wall clocks (1 s steps)."""
    if not log.is_file():
        return None
    text = log.read_text()
    clocks = [re.findall(pat, text) for _, pat, _ in _PHASES]
    if not all(clocks):
        return None
    secs = [sum(int(x) * f for x, f in zip(c[which].split(":"), (3600, 60, 1)))
            for c, (_, _, which) in zip(clocks, _PHASES)]
    t0 = secs[2] - run["start_s"]                       # engine up is start_s after the start
    return [x - t0 for x in secs]


def process_times(*dirs: Path) -> list[str]:
    """Per probe process in run order: its vLLM import, when the engine arguments, the engine
    core's first log line, engine up and the last batch size's result came (seconds after the
    process start, from the log's clock), and its wall seconds."""
    runs = sorted(((r, p) for d in dirs for p in sorted(d.glob("run-r*-*.json"))
                   for r in [json.loads(p.read_text())] if r.get("rows")),
                  key=lambda rp: (rp[0].get("ended", 0.0), rp[0]["round"]))
    out = ["| run | round | variant | vLLM import | " + " | ".join(n for n, _, _ in _PHASES)
           + " | process wall |", "|---:|---:|---|" + "---:|" * (len(_PHASES) + 2)]
    for i, (r, p) in enumerate(runs, 1):
        imp = f"{r['import_s']:.0f}" if "import_s" in r else "n/a"
        ph = _phase_s(r, p.with_suffix(".log"))
        cells = [f"{x:.0f}" for x in ph] if ph else ["n/a"] * len(_PHASES)
        out.append(f"| {i} | {r['round']} | {r['variant']} | {imp} | " + " | ".join(cells)
                   + f" | {r['wall_s']:.0f} |")
    out += ["", "Seconds after the process start."]
    return out


def tune_phases(log: Path) -> list[str]:
    """`moe-serve tune` per model and dtype: wall time of the search call (--no-vllm) and of
    the vLLM-timing/routing call, and what the routing call measured (ours / vLLM)."""
    text = log.read_text()
    t: dict[tuple[str, str, str], dict[str, int]] = {}
    for m in re.finditer(r"^TUNE_TIME (\S+) tp(\d+) (\w+) (\S+) (\d+)s$", text, re.M):
        t.setdefault((m[1], m[2], m[3]), {})[m[4]] = int(m[5])
    measured = {(m[1].split("/")[0], m[2].removeprefix("TP"), m[3]): (m[4], m[5]) for m in re.finditer(
        r"^\[tune\] (\S+?)/(TP\d+) .* (\w+): tuned in \d+s; vs vLLM (M=1 [\d.]+x, M=8 [\d.]+x, "
        r"M=64 [\d.]+x); ours for M in (\S+)$", text, re.M)}
    out = ["| model | TP | dtype | search (`--no-vllm`) | vLLM timing + routing | total | "
           "ours / vLLM (routing call) | routed to ours |", "|---|---|---|---:|---:|---:|---|---|"]
    for (model, tp, dt), ph in t.items():
        s, v = ph.get("--no-vllm"), ph.get("with-vllm")
        tot = f"{s + v} s" if s is not None and v is not None else "n/a"
        sp, ours = measured.get((model, tp, dt), ("n/a", "n/a"))
        out.append(f"| {model} | {tp} | {dt} | {s if s is not None else 'n/a'} s | "
                   f"{v if v is not None else 'n/a'} s | {tot} | {sp} | M in {ours} |")
    return out


def _kernel_us(path: Path, shape: str, dtype: str, timing: str = "_us"
               ) -> tuple[str, dict[int, dict[str, float]]]:
    """(stock kernel name, M -> {variant: kernel us}) for one shard, from either an fp8_backends.py
    file (stock = FlashInfer CUTLASS, with vllm-triton; `timing` "_l2cold_us" takes its L2-flushed
    times) or a bench_kernels.py file (stock = vLLM Triton)."""
    res = json.loads(path.read_text())
    if "rows" in res:
        fi, vt, sv = ("flashinfer_cutlass" + timing, "vllm_triton" + timing, "served" + timing)
        return "FI", {r["M"]: {"stock": r[fi], "moe-serve": r[sv], **({"vllm-triton": r[vt]} if r.get(vt) else {})}
                      for r in res["rows"] if r["shape"] == shape and r.get(fi) and r.get(sv)}
    return "vLLM Triton", {r["M"]: {"stock": r["vllm_us"], "moe-serve": r["vllm_us"] / r["served_speedup"]}
                           for r in res["bench"] if r["shape"] == shape and r["dtype"] == dtype
                           and r.get("vllm_us") and r.get("served_speedup")}


def moe_share(shape: str, dtype: str, layers: int, kernels: Path, *dab_dirs: Path,
              timing: str = "_us") -> list[str]:
    """Per B: the MoE share of a stock decode step (layers x stock's kernel time / step) and, per
    variant run beside stock, the end-to-end ratio its kernel time predicts and the measured one
    (`timing`: which kernel times of an fp8_backends.py file, see _kernel_us)."""
    stock_name, kern = _kernel_us(kernels, shape, dtype, timing)
    pp = decode_stats.per_process(decode_stats.load_runs(list(dab_dirs)))
    others = [v for v in ("moe-serve", "vllm-triton")
              if v in pp and any(v in k for k in kern.values())] or ["moe-serve"]
    out = [f"| B | stock step (ms) | MoE share of it ({layers} x {stock_name} kernel) | "
           + " | ".join(f"predicted {v} / stock | measured" for v in others) + " |",
           "|---|---:|---:|" + "---:|---:|" * len(others)]
    for b in sorted((int(k) for k in pp.get("stock", {}) if k.isdigit())):
        if b not in kern:
            continue
        step = 1e3 * b / geometric_mean(pp["stock"][str(b)])          # ms per decode step
        base = layers * kern[b]["stock"] / 1e3
        cells = []
        for v in others:
            meas = geometric_mean(pp[v][str(b)]) / geometric_mean(pp["stock"][str(b)]) if v in pp else None
            pred = step / (step - base + layers * kern[b][v] / 1e3) if v in kern[b] else None
            cells += ["n/a" if pred is None else f"{pred:.3f}", "n/a" if meas is None else f"{meas:.3f}"]
        out.append(f"| {b} | {step:.3f} | {100 * base / step:.0f} % | " + " | ".join(cells) + " |")
    return out


def moe_bound(shape: str, dtype: str, kernels: Path, *dirs: Path) -> list[str]:
    """Per profiled stock process and B: the MoE kernels' measured share of the step
    (bench/decode_profile.py), the served kernel speedup at M = B from a kernel file, and the
    end-to-end ratio that share and speedup allow at most: 1 / (1 - share * (1 - 1/speedup))."""
    _, kern = _kernel_us(kernels, shape, dtype)
    out = ["| round | B | step (ms) | MoE kernels (ms) | MoE share | served kernel speedup at M = B | "
           "end-to-end bound |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in decode_stats.load_runs(list(dirs)):
        if r["variant"] != "stock" or not r.get("profile"):
            continue
        for row in r["rows"]:
            p, k = r["profile"].get(str(row["B"])), kern.get(row["B"])
            if p is None or k is None:
                continue
            moe_ms = decode_profile.per_step(p, row["step_ms"])["moe_ms"]
            share, speedup = moe_ms / row["step_ms"], k["stock"] / k["moe-serve"]
            out.append(f"| {r['round']} | {row['B']} | {row['step_ms']:.3f} | {moe_ms:.3f} | "
                       f"{100 * share:.0f} % | {speedup:.3f} | {1 / (1 - share * (1 - 1 / speedup)):.3f} |")
    return out


def fp8_aligned(path: Path, served_candidate: str | None = None) -> list[str]:
    """bench_kernels --fp8-aligned: per shape, format and M, the aligned path forced on its untuned
    config with activations quantized once (the default) and inside the K loop, against vLLM's
    fused_experts (µs per MoE layer call, CUDA-graph replays); speedup = vLLM's / ours. Rows that
    also timed candidate tiles (`cfg_<tag>`, each checked against vLLM's output first) get a second
    table; `served_candidate` names the candidate the untuned rule now serves in those cells, and
    the closing count uses it there."""
    rows = json.loads(path.read_text())["fp8-aligned"]
    out = ["| shape | format | M | config | ours, quantized once µs | ours, in the K loop µs | "
           "vLLM µs | speedup (once) | speedup (in loop) |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['dtype']} | {r['M']} | {r['cfg']} | {_us(r.get('ours_once_us'))} | "
                   f"{_us(r.get('ours_inloop_us'))} | {_us(r.get('vllm_us'))} | "
                   f"{_ratio(r.get('vllm_us'), r.get('ours_once_us'))} | "
                   f"{_ratio(r.get('vllm_us'), r.get('ours_inloop_us'))} |")
    tags = list(dict.fromkeys(k[len("cfg_"):] for r in rows for k in r if k.startswith("cfg_")))
    cand = [r for r in rows if any(f"cfg_{t}" in r for t in tags)]
    if cand:
        out += ["", "Candidate tiles where the untuned config is vLLM's BLOCK_M = 32 tile (each candidate's "
                "output first checked against vLLM's: max relative error; a candidate over the tolerance "
                "is not timed):", "",
                "| shape | format | M | untuned config speedup | " + " | ".join(
                    f"`{t}` config | `{t}` µs | `{t}` speedup | `{t}` err vs vLLM" for t in tags) + " |",
                "|---|---|---:|---:|" + "---|---:|---:|---:|" * len(tags)]
        def err(r: dict, t: str) -> str:
            return f"{r[f'err_vs_vllm_{t}']:.4f}" if f"err_vs_vllm_{t}" in r else "n/a"

        for r in cand:
            cells = [f"{r.get(f'cfg_{t}', '')} | {_us(r.get(f'ours_{t}_us'))} | "
                     f"{_ratio(r.get('vllm_us'), r.get(f'ours_{t}_us'))} | {err(r, t)}" for t in tags]
            out.append(f"| {r['shape']} | {r['dtype']} | {r['M']} | "
                       f"{_ratio(r.get('vllm_us'), r.get('ours_once_us'))} | " + " | ".join(cells) + " |")

    def served_us(r: dict) -> float | None:
        key = f"ours_{served_candidate}_us"
        return r[key] if served_candidate and key in r else r.get("ours_once_us")

    timed = [r for r in rows if r.get("vllm_us") and served_us(r)]
    below = [r for r in timed if r["vllm_us"] < served_us(r)]
    how = (f"Quantized once, with the `{served_candidate}` tile where it was timed" if served_candidate
           and any(f"ours_{served_candidate}_us" in r for r in rows) else "Quantized once")
    out += ["", f"{how}, ours is at least as fast as vLLM in {len(timed) - len(below)} of "
            f"{len(timed)} cells; below it: " + (", ".join(
                f"{r['shape']} {r['dtype']} M = {r['M']} ({r['vllm_us'] / served_us(r):.2f}x)"
                for r in below) or "none") + "."]
    return out


def format_bench(path: Path, max_m: int = 64) -> list[str]:
    """bench_kernels --format-bench: per shape, format and M, ours as served (its table, or the
    default rule), vLLM's fused_experts for that format and the streaming floor of the bytes hit
    (FP8 weights plus their scales) at the run's copy ceiling; µs per MoE layer call."""
    res = json.loads(path.read_text())
    rows = [r for r in res["format-bench"] if "M" in r]
    out = [f"Copy ceiling {res['ceiling']['copy_bytes_per_s'] / 1e12:.2f} TB/s.", "",
           "| shape | format | M | route | ours µs | vLLM µs | floor µs | vLLM / ours | ours / floor | "
           "ours config |", "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        vl = _us(r.get("vllm_us")) if "vllm_us" in r else "raises" if r.get("vllm_error") else "n/a"
        fl = r.get("floor_us")
        out.append(f"| {r['shape']} | {r['dtype']} | {r['M']} | {r.get('route', '')} | {_us(r.get('ours_us'))} | "
                   f"{vl} | {_us(fl)} | {_ratio(r.get('vllm_us'), r.get('ours_us'))} | "
                   f"{_ratio(r.get('ours_us'), fl)} | {r.get('cfg', '')} |")
    out += ["", f"Per shape and format over M <= {max_m}: geomean vLLM / ours, the lowest served ratio, "
            "ours / floor at M = 1:", ""]
    for key in dict.fromkeys((r["shape"], r["dtype"]) for r in rows):
        rs = [r for r in rows if (r["shape"], r["dtype"]) == key]
        sp = [r["speedup"] for r in rs if "speedup" in r and r["M"] <= max_m]
        served = [r["served_speedup"] for r in rs if "served_speedup" in r]
        m1 = next((r for r in rs if r["M"] == 1 and "ours_vs_floor" in r), None)
        err = next((r["vllm_error"] for r in rs if r.get("vllm_error")), None)
        out.append(f"- {key[0]} `{key[1]}`: " + (
            f"geomean **{geometric_mean(sp):.2f}x** over {len(sp)} M, served min {min(served):.2f}x"
            if sp else f"no vLLM baseline (vLLM's kernel raised: {err})" if err else "no vLLM baseline")
            + (f"; M = 1 at {m1['ours_vs_floor']:.2f}x the floor" if m1 else "") + ".")
    return out


def tune_routing_points(key: str, path: Path) -> list[str]:
    """The points one `moe-serve tune` routing file measured for one shape key: per M, ours (with
    the new table) and vLLM's fused_experts in µs, one reading each, and the route it set."""
    ent = json.loads(path.read_text())["shapes"][key]
    ranges = ", ".join(f"{r['m_min']}-{r['m_max'] or ''}: {r['backend']}" for r in ent["ranges"])
    out = [f"`{key}` ({ent['name']}, top-{ent['topk']}); routes {ranges}", "",
           "| M | ours µs | vLLM µs | vLLM / ours | config |", "|---:|---:|---:|---:|---|"]
    for m, p in sorted(ent["measured"].items(), key=lambda kv: int(kv[0])):
        out.append(f"| {m} | {_us(p.get('ours_us'))} | {_us(p.get('vllm_us'))} | "
                   f"{_ratio(p.get('vllm_us'), p.get('ours_us'))} | {p.get('cfg', '')} |")
    return out
