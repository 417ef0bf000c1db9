"""Which MoE config table vLLM's own Triton kernel runs in the yardstick, and the log that shows it.

vLLM's fused MoE reads one JSON table per (E, N, format, GPU), named by
`vllm.model_executor.layers.fused_moe.fused_moe.get_config_file_name(E, N, dtype, block_shape)`
(`table_name` is that function with the device name as an argument, so it runs without a GPU):
first in `$VLLM_TUNED_CONFIG_FOLDER`, then in the tables vLLM ships (its `configs` folder),
else it runs its default config. The yardstick gives every server the same
`VLLM_TUNED_CONFIG_FOLDER` (`--vllm-tuned-config-folder`: e.g. what `moe-serve tune --for-vllm`
wrote); `expected` says per MoE shape which file vLLM will load ("tuned", "shipped" or
"default") with its sha256, and `logged` reads what the server then said it loaded ("Using
configuration from PATH for MoE layer." / "Using default MoE config. ... Config file not found at
PATHS"). `disagreement` compares the two; `label` and `row_label` word a row's baseline for the
tables.
"""
from __future__ import annotations

import hashlib
import importlib.util
import lzma
import re
from pathlib import Path
from typing import Any

from moe_serve.kernels.tuning.model_shapes import ModelConfigError, moe_shapes

LOADED = re.compile(r"Using configuration from (\S+) for MoE layer")
DEFAULT = re.compile(r"Using default MoE config\..*?Config file not found at (.+)$", re.M)
CPU = "cpu"                     # the host probe's GPU name on the CPU engine (no Triton MoE runs there)
TRITON_BACKENDS = ("TRITON", "TritonExperts")


def device_file_name(gpu: str) -> str:
    """vLLM's `get_device_name_as_file_name` of a device name (runs of spaces and slashes -> _)."""
    return re.sub(r"[\s/]+", "_", gpu)


def table_name(E: int, N: int, dtype: str | None, block_shape: list[int] | None, device_name: str) -> str:
    """vLLM's table file name for E experts of per-rank intermediate size N, its config dtype
    (None: bf16/fp16, "fp8_w8a8", ...), its block shape (block FP8) and a device file name
    (every H200 variant reads the NVIDIA_H200 tables)."""
    if "H200" in device_name.split("_"):
        device_name = "NVIDIA_H200"
    dtype_part = f",dtype={dtype}" if dtype else ""
    block_part = f",block_shape={block_shape}".replace(" ", "") if block_shape and all(block_shape) else ""
    return f"E={E},N={N},device_name={device_name}{dtype_part}{block_part}.json"


def shipped_dir() -> Path | None:
    """The folder of the tables this host's vLLM ships (found without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "model_executor" / "layers" / "fused_moe" / "configs"
    return folder if folder.is_dir() else None


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def expected(cfg: dict[str, Any], tp: int, gpu: str, tuned: Path | None,
             shipped: Path | None) -> dict[str, Any]:
    """{"device_name", "tables": [{"file", "source", "path", "sha256"}, ...]}: per MoE shape of the
    model at tensor-parallel size tp on `gpu`, the table vLLM will load (tuned folder first, then
    shipped, as vLLM looks) or source "default" with path and sha256 None. No MoE shape that
    model_shapes can read: "tables": []."""
    from moe_serve.kernels.moe.vllm_kernels import vllm_dtype   # torch: only where a run looks its table up

    device = device_file_name(gpu)
    try:
        shapes = moe_shapes(cfg, tp=tp)
    except ModelConfigError:
        shapes = []
    tables = []
    for name in sorted({table_name(s.E, s.N, *vllm_dtype(s.dtype), device) for s in shapes}):
        found = next(((src, folder / name) for src, folder in (("tuned", tuned), ("shipped", shipped))
                      if folder is not None and (folder / name).is_file()), None)
        tables.append({"file": name, "source": found[0] if found else "default",
                       "path": str(found[1]) if found else None, "sha256": sha256_of(found[1]) if found else None})
    return {"device_name": device, "tables": tables}


def logged(log_text: str) -> dict[str, list[str]]:
    """{"loaded": paths vLLM said it loaded, "default": the paths it said it did not find, "lines":
    those log lines as vLLM wrote them (the evidence a run record keeps)}."""
    lines = [ln.strip() for ln in log_text.splitlines() if LOADED.search(ln) or DEFAULT.search(ln)]
    return {"loaded": sorted(set(LOADED.findall(log_text))),
            "default": sorted({p.strip() for line in DEFAULT.findall(log_text) for p in line.split(", ")}),
            "lines": sorted(set(lines))}


def disagreement(record: dict[str, Any], seen: dict[str, list[str]], gpu: str, moe_backend: str | None) -> str | None:
    """Why the server's log does not show the tables `record` (from `expected`) said it would
    load; None where it does. The CPU engine runs no Triton MoE (no line is due); on a GPU a
    MoE backend other than Triton reads no table either (then no line is due, but none may name
    another file)."""
    loaded = {Path(p).name: p for p in seen["loaded"]}
    missing = {Path(p).name for p in seen["default"]}
    if gpu == CPU or (moe_backend is not None and moe_backend not in TRITON_BACKENDS):
        stray = sorted(set(loaded) - {t["file"] for t in record["tables"]})
        return f"the log names {', '.join(stray)}, not in the record" if stray else None
    for t in record["tables"]:
        if t["source"] == "default":
            if t["file"] in loaded:
                return f"{t['file']}: recorded as default, but the log says vLLM loaded {loaded[t['file']]}"
            if t["file"] not in missing:
                return f"{t['file']}: recorded as default, but the log has no 'Using default MoE config' line for it"
        elif loaded.get(t["file"]) != t["path"]:
            return (f"{t['file']}: recorded {t['source']} at {t['path']}, but the log says "
                    + (f"vLLM loaded {loaded[t['file']]}" if t["file"] in loaded else "nothing loaded for it"))
    return None


def label(records: list[dict[str, Any]]) -> str:
    """A row's baseline table in words, from its baseline processes' records (`expected`):
    "tuned for vLLM: FILE (sha256 …)", "vLLM's shipped FILE", "default (untuned)"; records that
    differ are joined by " / "."""
    said = []
    for rec in records:
        parts = []
        for t in rec["tables"]:
            if t["source"] == "tuned":
                parts.append(f"tuned for vLLM (`VLLM_TUNED_CONFIG_FOLDER`): `{t['file']}` (sha256 {t['sha256'][:12]})")
            elif t["source"] == "shipped":
                parts.append(f"vLLM's shipped `{t['file']}`")
            else:
                parts.append(f"default (untuned: no `{t['file']}`)")
        text = "; ".join(parts) or "none (no MoE shape read)"
        if text not in said:
            said.append(text)
    return " / ".join(said)


def server_log(d: Path) -> str | None:
    """A yardstick process's server log as kept in its folder (server.log, or server.log.xz in a
    claim folder); None where neither is."""
    for name in ("server.log", "server.log.xz"):
        if (d / name).is_file():
            data = (d / name).read_bytes()
            return (lzma.decompress(data) if name.endswith(".xz") else data).decode(errors="replace")
    return None


def seen_by(d: Path, meta: dict[str, Any]) -> dict[str, list[str]] | None:
    """What process d's log says vLLM loaded: read from its kept log, else the lines the run kept
    in meta.json; None where neither is."""
    text = server_log(d)
    return logged(text) if text is not None else meta.get("vllm_moe_table_logged")


def row_label(procs: list[tuple[Path, dict[str, Any]]], fallback: str) -> str:
    """A row's `vllm serve` MoE table from its baseline processes (dir, meta): what they recorded
    and in how many the log agrees; for runs before the record, what their kept server logs say;
    else `fallback`."""
    recorded = [m["vllm_moe_table"] for _, m in procs if "vllm_moe_table" in m]
    if recorded and len(recorded) == len(procs):
        backends = sorted({b for _, m in procs if (b := (m.get("backends") or {}).get("moe"))
                           and b not in TRITON_BACKENDS})
        agree = sum((seen := seen_by(d, m)) is not None and disagreement(
            m["vllm_moe_table"], seen, m.get("gpu", ""), (m.get("backends") or {}).get("moe")) is None for d, m in procs)
        return (label(recorded) + f" (the server log agrees in {agree} of {len(procs)})"
                + (f"; MoE backend {' / '.join(backends)}: reads no table" if backends else ""))
    said = []
    for d, _ in procs:
        text = server_log(d)
        if text is None:
            continue
        seen = logged(text)
        said.append(" / ".join([f"`{Path(p).name}` loaded" for p in seen["loaded"]]
                               + [f"default (untuned: no `{name}`)" for name in sorted({Path(p).name for p in seen["default"]})])
                    or "no MoE table line")
    if said:
        return (f"{' / '.join(sorted(set(said)))}: not recorded, read from the server.log of {len(said)} of "
                f"{len(procs)} `vllm serve` processes")
    return fallback
