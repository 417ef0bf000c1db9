"""The plugin's expert load: per MoE layer, the tokens routed to each expert, counted on the device
in every forward pass of a worker and read off the decode path.

Where: vLLM's ``FusedMoERouter.select_experts`` (the entry of every router class, 0.26 and 0.32)
returns each MoE call's topk_ids; wrapped here, it adds them into the layer's row of the worker's
load [L, E] (moe_serve.kernels.moe.expert_count: one Triton launch on CUDA, inside vLLM's opaque MoE op,
recorded by CUDA-graph capture and replayed with the graph; on vLLM's CPU engine, where
torch.compile traces the MoE layer, an in-place ``index_add_`` the compiled graph performs).
Where our router serves the call (kernels/plugin/router_hook.py), its kernel adds them itself
(router_topk's counts) and the wrapper adds nothing: no extra launch at decode.

Real tokens only: the wrapped ``execute_model`` of the worker writes the step's scheduled tokens
into a device scalar before the forward (one fill launch, no sync), so the padding rows of a batch
replayed from a CUDA graph of a larger size do not count. Forwards that do not come through
``execute_model`` (vLLM's profile run, warm-up, graph capture) find it at 0 and count nothing;
every start of serving (MoePlugin.serve: after vLLM's warm-up, and again after the API process's
request warm-up) zeroes the counts too. So the counts are the served traffic: tokens x top-k per
layer, every forward counted once.

Logical experts: with vLLM's expert-parallel load balancer (EPLB) a router returns physical expert
slots (a logical expert may have replicas); the count maps each slot to its logical expert through
the router's own EPLB state (``eplb_state.logical_to_physical_map``, which vLLM updates in place
when it rearranges), on the device at every call (moe_serve.kernels.moe.expert_count.physical_to_logical).
Ids that name no logical expert are counted in the row's column E (its out-of-range count), not
dropped. Our router kernel picks logical experts itself.

``POST /v1/moe/expert-load/reset`` asks every worker for its counts at that moment
(kes.SNAPSHOT_RPC over vLLM's collective_rpc: the device synchronized, a snapshot written and
returned), so nothing the workers counted before the reset is in what follows it.

Layers: vLLM's MoE runners (``compilation_config.static_all_moe_layers``), found when the worker
has loaded the model, before its first forward is traced or captured: each runner's router gets a
LayerSlot attribute. Not counted: expert methods that route inside their own kernel (vLLM's
monolithic ones never call select_experts). Reading: a SnapshotWriter thread copies the counts to
the host every second (a side CUDA stream and its own event; the decode path never waits) and
writes kernels/plugin/expert_snapshot.py's file. Off: the expert_stats setting (kernels/config.py;
moe-serve --no-expert-stats): nothing is wrapped or allocated.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from moe_serve.kernels.moe.expert_count import count_experts, physical_to_logical
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin import expert_snapshot as kes
from moe_serve.kernels.plugin.expert_snapshot import LayerInfo, SnapshotWriter, window_from_env
from moe_serve.kernels.plugin.plugin_host import PluginHost

SLOT_ATTR = "_moe_serve_expert_load"   # on vLLM's router objects
ROW_ALIGN = 16   # load rows padded to 16 int64 (128 B): every row's pointer has the same Triton specialization


@dataclass(frozen=True, eq=False)
class LayerSlot:
    """What a router's calls count into: row `row` of the worker's load, its first `experts`
    columns (logical experts) and column `experts` (ids out of range), for the first num_tokens
    tokens of a call. Under EPLB, `placement` is the router's EPLB state and `slots` its physical
    expert slots."""

    load: torch.Tensor          # [L, W] int64, W > every layer's experts
    row: int
    experts: int
    num_tokens: torch.Tensor    # [1] int32: the forward's real tokens
    placement: Any = None       # vLLM's EplbLayerState (logical_to_physical_map [E, R]), or None
    slots: int = 0              # physical expert slots (the router's global_num_experts) under EPLB

    def counts(self) -> torch.Tensor:
        return self.load[self.row, :self.experts]                     # [E]

    def count(self, topk_ids: torch.Tensor) -> None:
        """Add a call's routing (physical slots under EPLB) per logical expert."""
        placement = getattr(self.placement, "logical_to_physical_map", None)
        expert_map = None if placement is None else physical_to_logical(placement, self.slots)   # [slots]
        count_experts(topk_ids, self.counts(), self.num_tokens,
                      out_of_range=self.load[self.row, self.experts:self.experts + 1], expert_map=expert_map)


def logical_experts(router: Any) -> int:
    """A router's logical experts: the rows of its EPLB placement, else its global_num_experts."""
    placement = getattr(getattr(router, "eplb_state", None), "logical_to_physical_map", None)
    return int(placement.shape[0]) if placement is not None else int(getattr(router, "global_num_experts", 0))


def layer_number(name: str, position: int) -> int:
    """The decoder layer a vLLM layer name points into ('model.layers.3.mlp.experts' -> 3), else
    the layer's position among the MoE layers."""
    numbers = re.findall(r"\.(\d+)(?=\.)", f".{name}.")
    return int(numbers[-1]) if numbers else position


class ExpertLoad:
    """One worker's expert load: the wrappers, the device counts, their snapshots."""

    def __init__(self, plugin: PluginHost) -> None:
        self.plugin = plugin
        self.layers: list[LayerInfo] = []
        self.load: torch.Tensor | None = None         # [L, E_max padded] int64, on the model's device
        self.num_tokens: torch.Tensor | None = None   # [1] int32
        self.lock = threading.Lock()                  # counts zeroed vs. read
        self.writer: SnapshotWriter | None = None
        self._local = threading.local()               # .counted: the router our router kernel counted for
        self._copy: tuple[torch.Tensor, Any, Any] | None = None   # pinned host, side stream, event

    # -- install (worker init) ----------------------------------------------------------------
    def install(self, worker: Any) -> list[str]:
        """Wrap vLLM's select_experts and this worker class's load_model and execute_model; give the
        worker the snapshot method the reset calls (kes.SNAPSHOT_RPC)."""
        setattr(worker, kes.SNAPSHOT_RPC, self.snapshot_now)
        done = []
        for cls, name, make in ((vc.load(vc.ROUTER_BASE), "select_experts", self._select_experts),
                                (type(worker), "load_model", self._load_model),
                                (type(worker), "execute_model", self._execute_model)):
            if vc.wrap_method(cls, name, make):
                done.append(f"{cls.__name__}.{name}")
        return done

    def _select_experts(self, orig: Callable) -> Callable:
        local = self._local

        def select_experts(router: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                           *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            slot = getattr(router, SLOT_ATTR, None)
            if slot is None:
                return orig(router, hidden_states, router_logits, *args, **kwargs)
            if torch.compiler.is_compiling():      # traced (vLLM-CPU): our router never runs here
                weights, ids = orig(router, hidden_states, router_logits, *args, **kwargs)
                slot.count(ids)
                return weights, ids
            local.counted = None
            weights, ids = orig(router, hidden_states, router_logits, *args, **kwargs)
            if local.counted is not router:
                slot.count(ids)
            local.counted = None
            return weights, ids
        return select_experts

    def _load_model(self, orig: Callable) -> Callable:
        def load_model(worker: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(worker, *args, **kwargs)
            try:
                self.attach(worker)
            except Exception as exc:  # noqa: BLE001 - serve without expert load rather than not at all
                self.plugin.log_once("expert_load", "moe-serve expert load: not counted: %r", exc)
            return out
        return load_model

    def _execute_model(self, orig: Callable) -> Callable:
        def execute_model(worker: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if self.num_tokens is not None:
                self.num_tokens.fill_(int(scheduler_output.total_num_scheduled_tokens))
            return orig(worker, scheduler_output, *args, **kwargs)
        return execute_model

    # -- layers ---------------------------------------------------------------------------------
    def attach(self, worker: Any) -> None:
        """Give every MoE runner's router of the loaded model its LayerSlot."""
        found = []
        for name, router in vc.moe_routers(worker.vllm_config):
            experts, top_k = logical_experts(router), getattr(router, "top_k", 0)
            if experts > 0 and top_k > 0:
                found.append((LayerInfo(name, layer_number(name, len(found)), experts, top_k), router))
        if not found:
            return
        device = worker.device
        self.layers = [info for info, _ in found]
        width = -(-(max(i.experts for i in self.layers) + 1) // ROW_ALIGN) * ROW_ALIGN   # + out of range
        self.load = torch.zeros(len(found), width, dtype=torch.int64, device=device)
        self.num_tokens = torch.zeros(1, dtype=torch.int32, device=device)
        for row, (info, router) in enumerate(found):
            placement = getattr(router, "eplb_state", None)
            eplb = getattr(placement, "logical_to_physical_map", None) is not None
            setattr(router, SLOT_ATTR, LayerSlot(self.load, row, info.experts, self.num_tokens, placement if eplb
                                                 else None, int(getattr(router, "global_num_experts", 0))))
        self.plugin.logger.info("moe-serve expert load: counting %d MoE layers (%d experts, top-%d) on %s",
                                len(found), self.layers[0].experts, self.layers[0].top_k, device)

    def counts_for_kernel(self, router: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(counts [E], num_tokens [1]) for our router kernel to add this call's experts to, the
        call marked counted (select_experts then adds nothing); None for an uncounted router."""
        slot = getattr(router, SLOT_ATTR, None)
        if slot is None:
            return None
        self._local.counted = router
        return slot.counts(), slot.num_tokens

    # -- serving and reading ----------------------------------------------------------------
    def restart(self, runtime_dir: str | None, rank: int | None) -> None:
        """Serving (re)starts: zero the counts, start or restart the snapshots (with a runtime dir)."""
        if self.load is None:
            return
        with self.lock:
            self.load.zero_()
            if self.load.is_cuda:
                torch.cuda.synchronize(self.load.device)   # zeroed before the next snapshot reads
            if self.writer is None and runtime_dir:
                self.writer = SnapshotWriter(runtime_dir, self.read, self.layers, rank, window_from_env(), self.lock)
            if self.writer is not None:
                self.writer.restart()

    def snapshot_now(self) -> dict[str, Any] | None:
        """kes.SNAPSHOT_RPC: the counts as they are now (the device's work so far included), written
        as this worker's snapshot and returned as kes.as_report's data; None before serving."""
        if self.load is None or self.writer is None:
            return None
        if self.load.is_cuda:
            torch.cuda.synchronize(self.load.device)   # every forward already launched, counted
        return self.writer.snapshot_now()

    def read(self) -> np.ndarray:
        """The counts now, int64 [L, E_max] on the host (a copy). On CUDA: copied on a side stream
        into pinned memory; only the calling thread waits."""
        load = self.load
        assert load is not None
        if not load.is_cuda:
            return load.numpy().copy()
        with torch.cuda.device(load.device):
            if self._copy is None:
                self._copy = (torch.empty(load.shape, dtype=load.dtype, pin_memory=True), torch.cuda.Stream(),
                              torch.cuda.Event())
            host, stream, done = self._copy
            with torch.cuda.stream(stream):
                host.copy_(load, non_blocking=True)
                done.record(stream)
            done.synchronize()
        return host.numpy().copy()
