"""What the routes share: settings, the engine handle, metrics, admission control."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from service.admission import Admission
from service.engine import EngineDead, EngineHandle, EngineNotReady
from service.metrics import ServiceMetrics
from service.settings import Settings


@dataclass
class ServerState:
    settings: Settings
    engine: EngineHandle
    registry: CollectorRegistry
    metrics: ServiceMetrics
    admission: Admission
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    exit_code: int = 0

    @classmethod
    def create(cls, settings: Settings, engine: EngineHandle) -> "ServerState":
        registry = CollectorRegistry()
        # vLLM workers report (plugin state, Triton JIT compiles) into files in this dir.
        from kernels.jit_export import WorkerCollector, prepare_runtime_dir

        registry.register(WorkerCollector(prepare_runtime_dir()))
        admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests,
                              settings.max_prompt_tokens_in_flight)
        return cls(
            settings=settings,
            engine=engine,
            registry=registry,
            metrics=ServiceMetrics(registry, settings.model_name, queued=lambda: admission.queued),
            admission=admission,
        )

    def engine_unavailable(self) -> Exception:
        """The exception that explains why the engine cannot take requests now."""
        if self.engine.dead or self.engine.start_error is not None:
            return EngineDead("engine is not running")
        return EngineNotReady("engine is starting")
