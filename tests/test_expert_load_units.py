"""The expert load's parts without an engine: the count at vLLM's real CPU router (eager and as
torch.compile traces it on the CPU engine) against the routing that router returns, a router under
EPLB (physical slots counted per logical expert, ids out of range apart), the worker's snapshots
and their window, the reset's snapshot over the RPC, the API process's merge and its Prometheus
families."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from moe_serve.kernels.plugin import expert_snapshot as es
from moe_serve.kernels.plugin import vllm_compat as vc
from moe_serve.kernels.plugin.expert_load import SLOT_ATTR, ExpertLoad, LayerSlot, layer_number, logical_experts
from moe_serve.service.errors import APIError
from moe_serve.service.expert_load import ExpertLoadSource, merge
from moe_serve.service.expert_load_metrics import ExpertLoadCollector, share_buckets
from tests.monitoring_helpers import parse_metrics, value

CPU_ROUTER = ("vllm.model_executor.layers.fused_moe.router.cpu_router", "CPURouter")


@pytest.fixture(scope="module")
def counting() -> ExpertLoad:
    """vLLM's FusedMoERouter.select_experts wrapped as a worker wraps it (only routers given a
    LayerSlot count)."""
    load = ExpertLoad(plugin=None)  # type: ignore[arg-type]
    vc.wrap_method(vc.load(vc.ROUTER_BASE), "select_experts", load._select_experts)
    return load


def _bincount(ids: torch.Tensor, E: int, real: int) -> list[int]:
    return np.bincount(ids[:real].reshape(-1).numpy(), minlength=E).tolist()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_counts_agree_with_vllms_router(counting: ExpertLoad, compiled: bool) -> None:
    """Every call of vLLM's CPU router adds exactly the experts it returned for the real tokens, into
    its layer's row only; traced by torch.compile (fullgraph, dynamic M) the graph does the same."""
    E, topk, K = 16, 4, 32
    routers = [vc.load(CPU_ROUTER)(top_k=topk, global_num_experts=E) for _ in range(2)]
    load = torch.zeros(3, E + 1, dtype=torch.int64)                # [L, E + 1]: + the out-of-range column
    num_tokens = torch.zeros(1, dtype=torch.int32)
    for row, router in enumerate(routers):
        setattr(router, SLOT_ATTR, LayerSlot(load, row * 2, E, num_tokens))

    def step(x: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(r.select_experts(x, logits)[1] for r in routers)

    run = torch.compile(step, fullgraph=True, dynamic=True) if compiled else step
    want = [[0] * E, [0] * E]
    for M, real in ((7, 7), (12, 9), (3, 3)):      # padded rows past `real` must not count
        num_tokens.fill_(real)
        ids = run(torch.randn(M, K), torch.randn(M, E))
        for i in range(2):
            assert ids[i].shape == (M, topk)
            want[i] = [w + c for w, c in zip(want[i], _bincount(ids[i], E, real))]
    assert load[0, :E].tolist() == want[0] and load[2, :E].tolist() == want[1] and not load[1].any()
    assert not load[:, E].any()                                    # vLLM's router names only its experts
    assert sum(want[0]) == (7 + 9 + 3) * topk


def test_a_call_our_router_kernel_counted_is_not_counted_again(counting: ExpertLoad) -> None:
    E = 8
    router = vc.load(CPU_ROUTER)(top_k=2, global_num_experts=E)
    load = torch.zeros(1, E + 1, dtype=torch.int64)
    setattr(router, SLOT_ATTR, LayerSlot(load, 0, E, torch.tensor([4], dtype=torch.int32)))
    real_compute = type(router)._compute_routing

    def in_kernel(self, *args, **kwargs):          # as router_hook does when ours serves the call
        assert counting.counts_for_kernel(self) is not None
        return real_compute(self, *args, **kwargs)

    type(router)._compute_routing = in_kernel
    try:
        router.select_experts(torch.randn(4, 16), torch.randn(4, E))
    finally:
        type(router)._compute_routing = real_compute
    assert not load.any()
    router.select_experts(torch.randn(4, 16), torch.randn(4, E))  # the next call is counted again
    assert load.sum() == 4 * 2


class EplbRouter(vc.load(vc.ROUTER_BASE)):
    """A router under vLLM's EPLB: it returns the physical slots it is told to, and carries the EPLB
    state vLLM gives a layer (logical_to_physical_map [E, R], updated in place when it rearranges)."""

    def __init__(self, placement: torch.Tensor, slots: int, top_k: int) -> None:
        super().__init__(eplb_state=SimpleNamespace(logical_to_physical_map=placement))
        self.global_num_experts, self.top_k, self.next_ids = slots, top_k, None

    def set_capture_fn(self, capture_fn) -> None:
        raise NotImplementedError

    @property
    def routing_method_type(self):
        raise NotImplementedError

    def _select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, *, input_ids=None):
        return torch.ones(self.next_ids.shape), self.next_ids


def _worker(routers: dict[str, object]) -> SimpleNamespace:
    """What ExpertLoad.attach reads of a vLLM worker: its device and the MoE runners vLLM registers."""
    cc = SimpleNamespace(static_all_moe_layers=list(routers),
                         static_forward_context={n: SimpleNamespace(router=r) for n, r in routers.items()})
    return SimpleNamespace(device=torch.device("cpu"), vllm_config=SimpleNamespace(compilation_config=cc))


def test_under_eplb_a_layer_is_counted_per_logical_expert(counting: ExpertLoad) -> None:
    """4 logical experts on 6 physical slots (experts 0 and 2 replicated); after a rearrangement
    (vLLM copies the new placement in place) the same slots count for their new experts; ids of no
    logical expert go to the layer's out-of-range column."""
    placement = torch.tensor([[0, 4], [1, -1], [2, 5], [3, -1]])          # logical -> its physical slots
    router = EplbRouter(placement, slots=6, top_k=2)
    counting.plugin = SimpleNamespace(logger=SimpleNamespace(info=lambda *a: None))
    counting.attach(_worker({"model.layers.0.mlp.experts": router}))
    assert logical_experts(router) == 4 and [(i.layer, i.experts) for i in counting.layers] == [(0, 4)]
    counting.num_tokens.fill_(3)
    router.next_ids = torch.tensor([[4, 1], [5, 6], [0, -1], [3, 3]])     # the last row is padding
    router.select_experts(torch.randn(4, 8), torch.randn(4, 6))
    assert counting.read()[0, :5].tolist() == [2, 1, 1, 0, 2]             # 4 -> 0, 5 -> 2; 6 and -1 apart
    placement.copy_(torch.tensor([[5, -1], [1, 4], [2, -1], [3, 0]]))    # rearranged: 0 -> 3, 4 -> 1, 5 -> 0
    router.next_ids = torch.tensor([[4, 5], [0, 2], [1, 1], [2, 2]])
    router.select_experts(torch.randn(4, 8), torch.randn(4, 6))
    assert counting.read()[0, :5].tolist() == [3, 4, 2, 1, 2]


def test_layer_numbers_come_from_vllms_names() -> None:
    assert layer_number("model.layers.3.block_sparse_moe.experts", 0) == 3
    assert layer_number("language_model.model.layers.47.mlp.experts", 5) == 47
    assert layer_number("experts", 5) == 5


def _snapshot(tmp_path: Path, read, layers, window_s: float = 60.0, rank: int = 0) -> es.SnapshotWriter:
    return es.SnapshotWriter(str(tmp_path), read, layers, rank, window_s, threading.Lock())


LAYERS = [es.LayerInfo("model.layers.0.mlp.experts", 0, 4, 2), es.LayerInfo("model.layers.1.mlp.experts", 1, 4, 2)]


def test_window_is_the_newest_snapshot_minus_the_one_at_its_start(tmp_path: Path, monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(es.time, "time", lambda: clock[0])
    counts = [np.zeros((2, 4), dtype=np.int64)]
    writer = _snapshot(tmp_path, lambda: counts[0].copy(), LAYERS, window_s=10.0)
    with writer.lock:
        writer.restart()                             # at 1000: zeros
    for t, add in ((1004.0, [[1, 2, 0, 0], [0, 0, 3, 0]]), (1009.0, [[5, 0, 0, 0], [0, 0, 0, 0]]),
                   (1013.0, [[0, 0, 0, 7], [1, 1, 1, 1]])):
        clock[0] = t
        counts[0] = counts[0] + np.array(add)
        with writer.lock:
            writer._write_locked()
    snap = es.read_snapshot(writer.path)
    assert snap is not None and snap["meta"]["layers"] == [vars(x) for x in LAYERS]
    assert snap["total"].tolist() == [[6, 2, 0, 7], [1, 1, 4, 1]]
    # window [1003, 1013]: the snapshot at or before its start is 1000's (zeros)
    assert snap["window"].tolist() == [[6, 2, 0, 7], [1, 1, 4, 1]] and snap["meta"]["window_span_s"] == 13.0
    clock[0] = 1016.0
    with writer.lock:
        writer._write_locked()
    snap = es.read_snapshot(writer.path)                  # window [1006, 1016]: minus 1004's
    assert snap["window"].tolist() == [[5, 0, 0, 7], [1, 1, 1, 1]] and snap["meta"]["window_span_s"] == 12.0
    clock[0] = 1020.0
    counts[0] = np.zeros((2, 4), dtype=np.int64)           # serving starts again: counts zeroed
    with writer.lock:
        writer.restart()
    snap = es.read_snapshot(writer.path)
    assert not snap["total"].any() and not snap["window"].any() and snap["meta"]["serving_since"] == 1020.0


def _snap(layers: list[es.LayerInfo], total: list[list[int]], window: list[list[int]], t: float) -> dict:
    return {"meta": {"layers": [vars(x) for x in layers], "time": t, "serving_since": 1.0, "window_s": 60.0,
                     "window_span_s": 30.0}, "total": np.array(total), "window": np.array(window)}


def test_merge_takes_one_tp_rank_and_every_pipeline_stages_layers() -> None:
    """TP ranks hold the same counts (max = either, never their sum); a stage's layers are its own;
    a row is a layer's experts, then its out-of-range count, then zeros for layers with fewer experts."""
    a, b = es.LayerInfo("m.layers.0.e", 0, 4, 2), es.LayerInfo("m.layers.1.e", 1, 2, 1)
    rank0 = _snap([a], [[1, 2, 3, 4, 7]], [[1, 0, 0, 1, 0]], 10.0)
    rank1 = _snap([a], [[1, 2, 3, 4, 7]], [[1, 0, 0, 1, 0]], 11.0)
    stage1 = _snap([b], [[5, 6, 9, 0, 0]], [[5, 0, 1, 0, 0]], 12.0)
    m = merge([stage1, rank0, rank1])
    assert m is not None and [x.layer for x in m.layers] == [0, 1] and m.workers == 3
    assert m.total.tolist() == [[1, 2, 3, 4, 7], [5, 6, 9, 0, 0]]
    assert m.window.tolist() == [[1, 0, 0, 1, 0], [5, 0, 1, 0, 0]]
    assert m.as_of == 10.0
    assert merge([]) is None


class Engine:
    """vLLM's AsyncLLM as the reset uses it: collective_rpc calls each worker's method now."""

    def __init__(self, *workers: object) -> None:
        self.workers = workers

    async def collective_rpc(self, method: str, timeout: float | None = None) -> list:
        return [getattr(w, method)() for w in self.workers]


def test_since_reset_starts_from_the_counts_at_the_reset_and_the_prometheus_families(tmp_path: Path) -> None:
    """The reset's baseline is what the workers count at the reset (their last file is older), so
    since_reset is zero right after it; column 4 of each row is the layer's out-of-range count."""
    counts = [np.array([[0, 3, 1, 0, 2], [2, 2, 2, 2, 0]], dtype=np.int64)]
    writer = _snapshot(tmp_path, lambda: counts[0].copy(), LAYERS)
    with writer.lock:
        writer.restart()
    counts[0] = counts[0] + np.array([[5, 0, 0, 0, 1], [0, 0, 0, 0, 0]])    # counted, not yet in a file
    source = ExpertLoadSource(tmp_path)
    worker = SimpleNamespace(**{es.SNAPSHOT_RPC: writer.snapshot_now})
    asyncio.run(source.reset(Engine(worker)))
    assert all(not any(layer["since_reset"]) and not layer["out_of_range"]["since_reset"]
               for layer in source.body()["layers"])
    counts[0] = counts[0] + np.array([[1, 1, 0, 0, 3], [0, 0, 0, 4, 0]])
    with writer.lock:
        writer._write_locked()
    body = source.body()
    assert [layer["since_reset"] for layer in body["layers"]] == [[1, 1, 0, 0], [0, 0, 0, 4]]
    assert [layer["total"] for layer in body["layers"]] == [[6, 4, 1, 0], [2, 2, 2, 6]]
    assert [layer["out_of_range"] for layer in body["layers"]] == [
        {"total": 6, "window": 6, "since_reset": 3}, {"total": 0, "window": 0, "since_reset": 0}]
    assert body["layers"][1]["summary"]["window"] == {"routed": 12, "tokens": 6, "imbalance": 2.0, "idle_experts": 0}
    registry = CollectorRegistry()
    registry.register(ExpertLoadCollector(source))
    m = parse_metrics(generate_latest(registry).decode())
    assert value(m, "moe_serve_expert_load_routed_total", layer="0") == 11
    assert value(m, "moe_serve_expert_load_out_of_range_total", layer="0") == 6
    assert value(m, "moe_serve_expert_load_imbalance", layer="0") == pytest.approx(6 * 4 / 11, abs=1e-4)
    assert value(m, "moe_serve_expert_load_idle_experts", layer="0") == 1
    assert value(m, "moe_serve_expert_load_experts_bucket", layer="0", le="0") == 1        # the idle one
    assert value(m, "moe_serve_expert_load_experts_bucket", layer="1", le="1") == 3
    assert value(m, "moe_serve_expert_load_experts_bucket", layer="1", le="+Inf") == 4
    assert share_buckets(np.zeros(4, dtype=np.int64)) == []


def test_a_reset_the_workers_cannot_answer_is_a_503(tmp_path: Path) -> None:
    class Dead:
        async def collective_rpc(self, method: str, timeout: float | None = None) -> list:
            raise TimeoutError

    source = ExpertLoadSource(tmp_path)
    for engine in (None, Dead()):
        with pytest.raises(APIError) as refused:
            asyncio.run(source.reset(engine))
        assert refused.value.status == 503 and source.reset_at is None


def test_snapshots_cross_nodes_as_plain_data(tmp_path: Path) -> None:
    writer = _snapshot(tmp_path, lambda: np.arange(8, dtype=np.int64).reshape(2, 4), LAYERS)
    with writer.lock:
        writer.restart()
    report = es.as_report(str(tmp_path))
    assert report is not None and report["total"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert es.from_report(report)["total"].tolist() == report["total"]
    es.remove_snapshots(str(tmp_path))
    assert es.read_snapshots(str(tmp_path)) == [] and es.as_report(str(tmp_path)) is None
