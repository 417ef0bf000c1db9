"""What the routes share: settings, the engine handle, metrics, admission control."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from moe_serve.service.admission import Admission
from moe_serve.service.engine import EngineHandle
from moe_serve.service.expert_load import ExpertLoadSource
from moe_serve.service.expert_load_metrics import ExpertLoadCollector
from moe_serve.service.grammar_checker import GrammarChecker
from moe_serve.service.metrics import ServiceMetrics
from moe_serve.service.settings import Settings
from moe_serve.service.worker_metrics import RemoteWorkers, WorkerMetricsCollector, prepare_runtime_dir


@dataclass
class ServerState:
    settings: Settings
    engine: EngineHandle
    registry: CollectorRegistry
    metrics: ServiceMetrics
    warmup_metrics: ServiceMetrics  # where the warm-up requests are counted (a registry nobody exports)
    admission: Admission
    grammar_checker: GrammarChecker  # structured-output constraints' cost (service/structured_limits.py)
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    warmed: bool = False  # the start-up warm-up requests are done (service/warmup.py); /health waits for it
    exit_code: int = 0
    runtime_dir: Path | None = None  # where vLLM workers write their metrics (service/worker_metrics.py)
    owns_runtime_dir: bool = False  # a temp dir we made (removed at exit)
    remote_workers: RemoteWorkers | None = None  # workers whose metrics files are on other nodes
    expert_load: ExpertLoadSource | None = None  # the workers' expert load; None with --no-expert-stats

    @classmethod
    def create(cls, settings: Settings, engine: EngineHandle) -> "ServerState":
        registry = CollectorRegistry()
        runtime_dir, owns_runtime_dir = prepare_runtime_dir()
        remote_workers = RemoteWorkers(runtime_dir)
        registry.register(WorkerMetricsCollector(runtime_dir, remote_workers))
        expert_load = ExpertLoadSource(runtime_dir, remote_workers) if settings.expert_stats else None
        if expert_load is not None:
            registry.register(ExpertLoadCollector(expert_load))
        admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests,
                              settings.max_prompt_tokens_in_flight)
        return cls(
            settings=settings,
            engine=engine,
            registry=registry,
            metrics=ServiceMetrics(registry, settings.model_name, queued=lambda: admission.queued),
            warmup_metrics=ServiceMetrics(CollectorRegistry(), settings.model_name, queued=lambda: 0,
                                          reexport_default_registry=False),
            admission=admission,
            grammar_checker=GrammarChecker(settings.structured_output_compile_budget_s,
                                           settings.structured_output_checkers),
            runtime_dir=runtime_dir,
            owns_runtime_dir=owns_runtime_dir,
            remote_workers=remote_workers,
            expert_load=expert_load,
        )

    async def refresh_worker_reports(self) -> None:
        """Ask the workers on other nodes for their plugin series (service/worker_metrics.py)."""
        if self.remote_workers is not None:
            await self.remote_workers.refresh(self.engine.engine if self.engine.healthy else None)

    def begin_shutdown(self) -> None:
        """Stop admitting: health turns 503, new and queued requests get 503."""
        self.shutting_down = True
        self.admission.close()

    def cleanup(self) -> None:
        """Remove what this process created on disk."""
        if self.owns_runtime_dir and self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def in_flight(self) -> int:
        """Requests admitted and not yet finished (streams included)."""
        return self.admission.running
