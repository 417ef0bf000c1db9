"""service/rejection_log.py: rejections logged in bounded words, at most one line per interval, and
vLLM's records of a client's fault (its traceback quotes the client's value) cut down to one line."""

from __future__ import annotations

import logging

import pytest

from moe_serve.service.errors import MAX_MESSAGE_CHARS, APIError, error_body
from moe_serve.service.rejection_log import MAX_LINE_CHARS, BoundedRecords, RateLimit, RejectionLog, describe, field_name

SECRET = "zq-client-secret"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture()
def logged() -> tuple[logging.Logger, Lines]:
    logger = logging.getLogger("test.rejection_log")
    handler = Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, handler
    logger.removeHandler(handler)


def test_a_rejection_is_named_by_status_code_type_field_and_size_never_its_text() -> None:
    err = APIError(400, f"value=[{SECRET!r}] " * 10_000, param="bad_words.17", code="invalid_value")
    line = describe(err, ValueError())
    assert line == f"400 invalid_value (ValueError), field bad_words, message of {len(err.message)} chars"
    assert field_name(f"{SECRET}.x") == "-" and field_name("logit_bias.5") == "logit_bias" and field_name(None) == "-"


def test_at_most_one_line_per_interval_and_the_next_says_how_many_were_left_out(logged) -> None:
    logger, handler = logged
    clock = Clock()
    log = RejectionLog(logger, RateLimit(1.0, clock))
    err = APIError(400, SECRET, param="logit_bias")
    assert [log("request rejected", err) for _ in range(5)] == [True, False, False, False, False]
    clock.now = 1.0
    assert log("request rejected", err)
    assert len(handler.lines) == 2 and handler.lines[1].endswith("; 4 more since the last line, not logged")
    assert not any(SECRET in line for line in handler.lines)


def _raised(exc: BaseException) -> tuple:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - its exc_info, as logger.exception records it
        return type(caught), caught, caught.__traceback__


def _lines(factory: BoundedRecords, level: int, msg: str, *args: object, exc: BaseException | None = None) -> str:
    """What a handler at INFO writes of one record the factory makes ('' when it leaves it out)."""
    record = factory("test", level, __file__, 1, msg, args, _raised(exc) if exc else None)
    return logging.Formatter("%(message)s").format(record) if record.levelno >= logging.INFO else ""


def test_a_client_fault_logged_with_its_traceback_becomes_one_line() -> None:
    """vLLM's handlers log e.g. a stream's bad_words error with logger.exception."""
    clock = Clock()
    factory = BoundedRecords(logging.LogRecord, lambda exc: isinstance(exc, ValueError), RateLimit(1.0, clock))
    fault = ValueError(f"Too many bad words (value=[{SECRET!r}] * 100000)")
    first = _lines(factory, logging.ERROR, "Error in stream generator: %s", SECRET, exc=fault)
    assert first == (f"Error in stream generator: %s [a client's fault: ValueError, message of {len(str(fault))} "
                     "chars, not logged]")
    assert _lines(factory, logging.ERROR, "Error in stream generator: %s", SECRET, exc=fault) == ""  # demoted
    clock.now = 1.0
    assert _lines(factory, logging.ERROR, "again", exc=fault).endswith("; 1 more since the last line, not logged]")


def test_other_lines_and_traceback_lines_are_cut() -> None:
    factory = BoundedRecords(logging.LogRecord, lambda exc: False)
    long_line = _lines(factory, logging.INFO, "x" * (3 * MAX_LINE_CHARS))
    assert len(long_line) < MAX_LINE_CHARS + 100 and "(cut: 12000 chars)" in long_line
    fault = _lines(factory, logging.ERROR, "server fault", exc=RuntimeError("y" * 100_000))
    assert fault.startswith("server fault\nTraceback") and len(fault) < 2000 and "RuntimeError: yyy" in fault


def test_the_error_object_echoes_at_most_max_message_chars() -> None:
    message = error_body(400, "token_id(s) [" + ", ".join(map(str, range(300_000))) + "]")["error"]["message"]
    assert len(message) < MAX_MESSAGE_CHARS + 80 and message.endswith("characters)")
    assert error_body(400, "short")["error"]["message"] == "short"
