"""Client faults in the API process's log: one bounded line each, at most one line per interval.

A rejected request's message can carry the client's own input (vLLM's validators quote the
offending value: a 300,000-key `logit_bias` makes a 4 MB message), so:

- our rejection lines (RejectionLog) name what was wrong (the HTTP status, the error code, the
  exception type, the top-level field) and the message's size, never its text;
- vLLM's own handlers log a client's fault with its traceback (`logger.exception`, e.g. a stream
  generator's bad_words): BoundedRecords, the process's log record factory, turns such a record
  into one line of the same kind, and cuts any other line at MAX_LINE_CHARS and any traceback line
  at MAX_TRACEBACK_LINE_CHARS.

Each keeps to a RateLimit: a flood of rejections writes one line per INTERVAL_S, the next line
saying how many were left out; every rejection is counted anyway, in
`moe_serve_requests_total{status="client_error"}` (service/metrics.py).
"""

from __future__ import annotations

import logging
import re
import time
import traceback
from collections.abc import Callable
from typing import Protocol

INTERVAL_S = 1.0
MAX_LINE_CHARS = 4000
MAX_TRACEBACK_LINE_CHARS = 500
_FIELD = re.compile(r"[a-z][a-z0-9_]{0,39}")  # a request model's field name (snake case, as vLLM's)


class Rejection(Protocol):
    """What a line tells of a rejection (moe_serve.service.errors.APIError has it)."""

    status: int
    code: str | None
    param: str | None
    message: str


def field_name(param: str | None) -> str:
    """The top-level field of an error's `param` ("logit_bias.5" -> "logit_bias"); "-" for none or
    for anything that does not look like a field name (a client's own key, say)."""
    head = (param or "").split(".", 1)[0]
    return head if _FIELD.fullmatch(head) else "-"


def describe(err: Rejection, exc: BaseException | None = None) -> str:
    """One rejection in bounded words: status, code, exception type, field, message size."""
    kind = type(exc).__name__ if exc is not None else "-"
    return (f"{err.status} {err.code or '-'} ({kind[:60]}), field {field_name(err.param)}, "
            f"message of {len(err.message)} chars")


class RateLimit:
    """At most one event per `interval_s`; `take()` says whether this one may be logged and how
    many were refused since the last that was."""

    def __init__(self, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._next_at = float("-inf")
        self._left_out = 0

    def take(self) -> tuple[bool, str]:
        """(allowed, the suffix that reports the ones left out before it)."""
        now = self.clock()
        if now < self._next_at:
            self._left_out += 1
            return False, ""
        more = f"; {self._left_out} more since the last line, not logged" if self._left_out else ""
        self._next_at, self._left_out = now + self.interval_s, 0
        return True, more


class RejectionLog:
    """Logs `what: describe(err)` at INFO within `limit`."""

    def __init__(self, logger: logging.Logger, limit: RateLimit | None = None) -> None:
        self.logger, self.limit = logger, limit or RateLimit()

    def __call__(self, what: str, err: Rejection, exc: BaseException | None = None) -> bool:
        """Log this rejection unless the limit says no; True if logged."""
        allowed, more = self.limit.take()
        if allowed:
            self.logger.info("%s: %s%s", what, describe(err, exc), more)
        return allowed


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... (cut: {len(text)} chars)"


class BoundedRecords:
    """A LogRecord factory around the one in place (logging.setLogRecordFactory: it holds for every
    logger and handler, whoever configures them later, as vLLM does at engine start). A record of
    a client's fault (`is_client_fault(exception)`) becomes one line without its traceback or
    message; past `limit` it is demoted to DEBUG, which a log at INFO leaves out. Other records are
    cut (MAX_LINE_CHARS, and each traceback line MAX_TRACEBACK_LINE_CHARS)."""

    def __init__(self, factory: Callable[..., logging.LogRecord], is_client_fault: Callable[[BaseException], bool],
                 limit: RateLimit | None = None) -> None:
        self.factory, self.is_client_fault, self.limit = factory, is_client_fault, limit or RateLimit()

    def __call__(self, *args: object, **kwargs: object) -> logging.LogRecord:
        record = self.factory(*args, **kwargs)
        try:
            self._bound(record)
        except Exception:  # noqa: BLE001 - a record we cannot read is logged as it is
            pass
        return record

    def _bound(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and self.is_client_fault(exc):
            allowed, more = self.limit.take()
            template = str(record.msg)  # the logging call's own text; its arguments may be the client's
            record.msg = (f"{_cut(template, 200)} [a client's fault: {type(exc).__name__[:60]}, "
                          f"message of {len(str(exc))} chars, not logged{more}]")
            record.args, record.exc_info, record.exc_text = (), None, None
            if not allowed:
                record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            return
        message = record.getMessage()
        if len(message) > MAX_LINE_CHARS:
            record.msg, record.args = _cut(message, MAX_LINE_CHARS), ()
        if record.exc_info and record.exc_info[0] is not None:
            lines = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n").splitlines()
            record.exc_text = "\n".join(_cut(line, MAX_TRACEBACK_LINE_CHARS) for line in lines)


_installed: BoundedRecords | None = None


def bound_logs(is_client_fault: Callable[[BaseException], bool]) -> None:
    """Make this process's log records bounded (BoundedRecords around the factory in place), once."""
    global _installed
    if _installed is None:
        _installed = BoundedRecords(logging.getLogRecordFactory(), is_client_fault)
        logging.setLogRecordFactory(_installed)
