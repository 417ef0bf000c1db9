"""PNG plots of a run (matplotlib, Agg backend): TTFT and throughput vs users, latency over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moe_serve.loadtest.records import Record  # noqa: E402

PLOTS = ("ttft_vs_users.png", "throughput_vs_users.png", "latency_over_time.png")
_FIG = dict(figsize=(6.4, 4.0), dpi=80)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _active(stages: list[dict]) -> list[dict]:
    return [s for s in stages if s["users"] > 0 and s["requests"] > 0]


def _users_axis(ax, x: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(x))
    ax.set_xticks(ticks, [str(v) for v in ticks])
    ax.minorticks_off()


def ttft_vs_users(stages: list[dict], title: str, path: Path) -> None:
    fig, ax = plt.subplots(**_FIG)
    rows = _active(stages)
    x = [s["users"] for s in rows]
    for key, label in (("ttft_p50_ms", "p50"), ("ttft_p90_ms", "p90"), ("ttft_p99_ms", "p99")):
        ax.plot(x, [s[key] for s in rows], marker="o", label=f"TTFT {label}")
    _users_axis(ax, x)
    ax.set(xlabel="concurrent users", ylabel="TTFT (ms)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def throughput_vs_users(stages: list[dict], title: str, path: Path) -> None:
    fig, ax = plt.subplots(**_FIG)
    rows = _active(stages)
    x = [s["users"] for s in rows]
    ax.plot(x, [s["output_tok_s"] for s in rows], marker="o", color="tab:green", label="output tok/s")
    _users_axis(ax, x)
    ax.set(xlabel="concurrent users", ylabel="output tokens / s", title=title)
    ax2 = ax.twinx()
    ax2.plot(x, [s["req_s"] for s in rows], marker="s", color="tab:gray", linestyle="--", label="requests / s")
    ax2.set_ylabel("requests / s")
    ax.grid(alpha=0.3)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    _save(fig, path)


def latency_over_time(records: list[Record], stages: list[dict], title: str, path: Path) -> None:
    fig, ax = plt.subplots(**_FIG)
    ok = [r for r in records if r.status == "ok" and r.ttft is not None and r.e2e is not None]
    ax.scatter([r.t_start for r in ok], [r.ttft * 1000 for r in ok], s=4, label="TTFT")
    ax.scatter([r.t_start for r in ok], [r.e2e * 1000 for r in ok], s=4,
               alpha=0.5, label="e2e")
    bad = [r for r in records if r.status == "error"]
    if bad:
        ax.scatter([r.t_start for r in bad], [1.0] * len(bad), marker="x", color="red", label="error")
    for s in stages:
        ax.axvline(s.get("start", 0.0), color="gray", lw=0.5)
    ax.set_yscale("log")
    ax.set(xlabel="request start (s)", ylabel="latency (ms)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(markerscale=3)
    _save(fig, path)


def write_plots(records: list[Record], stages: list[dict], title: str, out: Path) -> list[Path]:
    """Write the three PNGs into `out`; returns their paths."""
    paths = [out / name for name in PLOTS]
    ttft_vs_users(stages, title, paths[0])
    throughput_vs_users(stages, title, paths[1])
    latency_over_time(records, stages, title, paths[2])
    return paths
