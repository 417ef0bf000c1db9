"""One JSON line per request, written as it finishes (both engines), read back by the report."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from moe_serve.loadtest.scenarios import RequestSpec
from moe_serve.loadtest.stream import StreamTimer

RECORDS_FILE = "requests.jsonl"


@dataclass
class Record:
    """Times are seconds; `t_*` are relative to the run's start (stage 0 begins at 0)."""

    stage: int
    user: int
    kind: str
    endpoint: str
    max_tokens: int
    status: str  # ok | error | cancelled (user stopped mid-request; counts for throughput only)
    t_start: float
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None


def make_record(stage: int, user: int, spec: RequestSpec, timer: StreamTimer, status: str) -> Record:
    """A Record from a finished (or cancelled) timer whose times are run-relative."""
    return Record(stage=stage, user=user, kind=spec.kind, endpoint=spec.endpoint, max_tokens=spec.max_tokens,
                  status=status, t_start=timer.t_send, t_first=timer.t_first, t_last=timer.t_last,
                  t_end=timer.t_done, ttft=timer.ttft, itl=timer.itl, e2e=timer.e2e,
                  output_tokens=timer.output_tokens if timer.t_first is not None else 0,
                  prompt_tokens=timer.prompt_tokens, error=timer.error)


class RecordWriter:
    """Appends records to a JSONL file, flushing each line (results survive a killed run)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, rec: Record) -> None:
        line = json.dumps(asdict(rec), separators=(",", ":")) + "\n"
        with self._lock:
            if not self._fh.closed:
                self._fh.write(line)
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_records(path: Path) -> list[Record]:
    """All records of a JSONL file (a torn last line from a killed run is skipped)."""
    names = {f.name for f in fields(Record)}
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        out.append(Record(**{k: v for k, v in obj.items() if k in names}))
    return out
