"""The served model's MoE shapes against the tuned kernel tables for this GPU.

At start the server reads the model's config.json (moe_serve.kernels.tuning.model_shapes), looks up a tuned
table for each per-rank shape (moe_serve.kernels.moe.configs: env dir, `moe-serve tune`'s cache, shipped
tables; a table tuned under another Triton version is refused), logs one warning per untuned
shape naming the command that tunes it, and exports `moe_serve_moe_shape_info{shape, tuned,
routing}` (the routing of each shape's layer plan, kernels/plugin/layer_plan.py),
`moe_serve_moe_untuned_shapes` and `moe_serve_moe_refused_kernel_tables`. `moe-serve explain`
prints the same plans per M bucket (moe_serve.kernels.tuning.explain).
`--tune-on-start` runs that command (bounded) before the engine starts. The GPU's name comes
from NVML, so the API process never creates a CUDA context of its own.
"""
from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from moe_serve.kernels.config import current
from moe_serve.kernels.moe import configs, routing, selection
from moe_serve.kernels.plugin import layer_plan
from moe_serve.kernels.plugin.layer_plan import LayerFacts, PlanContext
from moe_serve.kernels.tuning.model_shapes import ModelConfigError, MoEShape, moe_shapes, read_config

logger = logging.getLogger(__name__)


def gpu_name() -> str:
    """configs.device_name()'s form of GPU 0's name via NVML ('cpu' without an NVIDIA GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library or no GPU
        return "cpu"
    return configs.device_file_name(name.decode() if isinstance(name, bytes) else name)


@dataclass(frozen=True)
class ShapeStatus:
    shape: MoEShape
    tuned: bool
    routing: str                     # its layer plan's describe(): '1-4:ours,5+:vllm'
    refused: tuple[str, ...] = ()    # its config and routing files refused (another Triton)

    @property
    def key(self) -> str:
        s = self.shape
        return f"E={s.E},N={s.N},K={s.K},topk={s.topk},dtype={s.dtype}"


def tune_command(model: str, tp: int, quantization: str | None) -> list[str]:
    cmd = ["moe-serve", "tune", "--model", model, "--tensor-parallel-size", str(tp)]
    return cmd + (["--quantization", quantization] if quantization == "fp8" else [])


def shape_statuses(model: str, tp: int, quantization: str | None,
                   device: str | None = None) -> list[ShapeStatus]:
    """Per MoE shape of one rank: tuned table present? and how routing splits it."""
    try:
        shapes = moe_shapes(read_config(model), tp, quantization)
    except (ModelConfigError, OSError, ValueError) as exc:
        logger.warning("MoE kernel tables: cannot read the model's MoE shapes (%s)", exc)
        return []
    dev = device or gpu_name()
    routing_refused = tuple((routing.load(dev) or {}).get("refused", []))
    ctx = PlanContext(current(), dev, None, "")
    out = []
    for s in shapes:
        found = configs.find_table(s.E, s.N, s.K, s.dtype, dev)
        plan = layer_plan.build(LayerFacts(s.E, s.N, s.K, s.topk, s.dtype, name=s.name, layers=s.layers), ctx)
        out.append(ShapeStatus(s, found.table is not None, plan.describe(), found.refused + routing_refused))
    return out


def warn_untuned(statuses: list[ShapeStatus], model: str, tp: int, quantization: str | None,
                 device: str) -> None:
    """One warning per untuned shape: on a GPU naming the command that tunes it there; on a
    machine without one (`device` 'cpu'), that tuning needs the GPU that will serve the model."""
    cmd = shlex.join(tune_command(model, tp, quantization))
    for st in statuses:
        if st.tuned:
            continue
        refused = f" (refused: {'; '.join(st.refused)})" if st.refused else ""
        if device == "cpu":
            logger.warning("MoE shape %s has no tuned kernel table%s: tuning needs an NVIDIA GPU and this "
                           "machine has none; tune on the GPU that will serve this model (README: MoE kernels "
                           "and tuning). Our kernels use their default configs (routing %s).",
                           st.key, refused, st.routing)
        else:
            logger.warning("MoE shape %s has no tuned kernel table for %s%s: our kernels use "
                           "their default configs (routing %s). Tune it on this GPU (minutes): %s",
                           st.key, device, refused, st.routing, cmd)


def export(statuses: list[ShapeStatus], registry: CollectorRegistry) -> None:
    info = Gauge("moe_serve_moe_shape_info", "The served model's per-rank MoE shapes: 1 per "
                 "shape, with whether a tuned table exists and the routing.",
                 ["shape", "tuned", "routing"], registry=registry)
    untuned = Gauge("moe_serve_moe_untuned_shapes", "MoE shapes of the served model with no "
                    "tuned kernel table for this GPU (run `moe-serve tune`).", registry=registry)
    for st in statuses:
        info.labels(st.key, str(st.tuned).lower(), st.routing).set(1)
    untuned.set(sum(not st.tuned for st in statuses))
    refused = Gauge("moe_serve_moe_refused_kernel_tables", "Kernel table files for the served "
                    "model refused because they were tuned under another Triton version (run "
                    "`moe-serve tune`).", registry=registry)
    refused.set(len({why for st in statuses for why in st.refused}))


def tune_on_start(model: str, tp: int, quantization: str | None, budget_minutes: float) -> int:
    """Run `moe-serve tune` for the model in a subprocess (its CUDA context ends with it)."""
    cmd = [sys.executable, "-c", "import sys; from moe_serve.service.cli import main; sys.exit(main())",
           *tune_command(model, tp, quantization)[1:], "--budget-minutes", str(budget_minutes),
           "--no-dense"]                       # the MoE shapes only: the dense search has no budget
    logger.info("tuning the model's MoE kernels before serving (budget %.1f min): %s",
                budget_minutes, shlex.join(cmd[3:]))
    rc = subprocess.run(cmd, timeout=budget_minutes * 60 * 1.5 + 120).returncode
    selection.clear_caches()
    if rc:
        logger.warning("moe-serve tune exited %d; serving with the default configs", rc)
    return rc
