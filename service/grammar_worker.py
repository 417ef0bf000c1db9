"""The structured-output checker process (`python -m moe_serve.service.grammar_worker`), run by
moe_serve.service.grammar_checker.

It imports xgrammar once, then answers checks: for each check it forks a child that converts each
grammar spec the way vLLM's xgrammar backend does (its whitespace settings included; `vllm serve`
converts JSON schemas and regexes the same way in its API process before the engine sees them)
and rejects rules that can never finish (moe_serve.service.grammar_productive). Compiling for the
vocabulary is the engine's alone: the request waits for it within its own timeout, as under
`vllm serve`. The budget is the child's CPU time, not wall time, so the verdict does not depend
on how busy the machine is; a child past it is killed: the conversion stops, its memory goes
with it, and the process stays free for the next check. A child may allocate at most
MAX_CHECK_MEMORY (more: the check fails, a 400).

Protocol, one JSON object per line. In: first `{"max_parallel": N, "any_whitespace": bool}`, then
`{"id": I, "specs": [[KIND, TEXT], ...], "budget_s": S}` or `{"cancel": I}`. Out: `{"ready": true}`
once, then per check `{"id": I, "ok": bool, "index": K, "error": TEXT, "seconds": S}` (`index`: the
spec that failed; `error` null with ok false: the budget ran out).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import selectors
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from moe_serve.service.grammar_productive import UnknownSyntax, dead_rules

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")  # "[07:20:53] /project/cpp/x.cc:49: "
MAX_ERROR_CHARS = 300
PR_SET_PDEATHSIG = 1  # prctl(2)
MAX_CHECK_MEMORY = 2 << 30  # bytes one check may allocate
POLL_S = 0.05  # how often a running child's CPU time is read
_TICKS = os.sysconf("SC_CLK_TCK")


def _grammar_is_likely_lark(text: str) -> bool:
    """vLLM's rule (v1/structured_output/utils.py): EBNF if any rule line has `::=`."""
    for line in text.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if line and "::=" in line:
            return False
    return True


def _choice_grammar(choices: list[str]) -> str:
    """vLLM's choice_as_grammar: `root ::= "a" | "b"` with EBNF escapes."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choices)


def _grammar(xgr: Any, kind: str, text: str, any_whitespace: bool = True) -> Any:
    """The xgrammar Grammar vLLM's xgrammar backend would compile for this spec (its
    compile_json_schema arguments for the engine's disable_any_whitespace)."""
    if kind == "json":
        return xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace,
                                            separators=None if any_whitespace else (",", ":"))
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_grammar(json.loads(text)))
    if kind == "grammar":
        return xgr.Grammar.from_lark(text) if _grammar_is_likely_lark(text) else xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:  # the legacy form
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return xgr.Grammar.from_structural_tag(text)
    raise ValueError(f"unknown spec kind {kind!r}")


def _message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _XGRAMMAR_LOG_PREFIX.sub("", text.splitlines()[0] if text else text)[:MAX_ERROR_CHARS]


def screen_specs(xgr: Any, specs: list[list[str]], any_whitespace: bool = True) -> dict[str, Any] | None:
    """Convert each spec and check it for dead rules: None when all pass, else the first failure."""
    for index, (kind, text) in enumerate(specs):
        try:
            grammar = _grammar(xgr, kind, text, any_whitespace)
        except Exception as exc:  # noqa: BLE001 - xgrammar's own wording is the client's answer
            return {"ok": False, "index": index, "error": f"it is not a valid {kind}: {_message(exc)}"}
        try:
            dead = dead_rules(str(grammar))
        except (UnknownSyntax, RecursionError):
            dead = []  # a form the reader does not know: the engine's compile is bounded by the request's timeout
        if dead:
            return {"ok": False, "index": index, "error": "no finite output satisfies it: it refers to "
                    f"itself with no way out (a $ref cycle or a rule that only repeats itself; grammar "
                    f"rules {', '.join(dead[:3])})"}
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)


def _bound_memory(extra_bytes: int) -> None:
    """Cap this process's data segment at what it uses now plus `extra_bytes`: a compile that
    allocates more fails (a 400) instead of taking the machine's memory."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmData:"):
                limit = int(line.split()[1]) * 1024 + extra_bytes
                resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
                return
    except (OSError, ValueError):
        pass  # no /proc, or a limit the system refuses: the time budget still holds


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a killed checker leaves no compile behind)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the checker still kills its children whenever it exits by itself


class _Lines:
    """Whole lines from a file descriptor, read unbuffered (so select() sees every one)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def read(self) -> list[str] | None:
        """The lines complete after one read; None at end of input."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in lines if line.strip()]

    def first(self) -> str:
        while b"\n" not in self.buffer:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise SystemExit("no configuration line")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


class _Zygote:
    """Forks one child per check (at most `max_parallel` at a time), kills children past budget."""

    def __init__(self, xgr: Any, max_parallel: int, commands: _Lines, any_whitespace: bool) -> None:
        self.xgr, self.max_parallel, self.commands = xgr, max_parallel, commands
        self.any_whitespace = any_whitespace
        self.sel = selectors.DefaultSelector()
        self.waiting: deque[dict[str, Any]] = deque()
        self.running: dict[int, dict[str, Any]] = {}  # child pid -> check (+ fd, started, data)

    def reply(self, message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    def start(self, check: dict[str, Any]) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: check, report, exit without running any of the parent's cleanup
            _die_with_parent()
            _bound_memory(MAX_CHECK_MEMORY)
            os.close(read_fd)
            try:
                result = screen_specs(self.xgr, check["specs"], self.any_whitespace) or {"ok": True}
            except BaseException as exc:  # noqa: BLE001 - reported, never raised in a fork
                result = {"ok": False, "index": 0, "error": f"the check failed: {_message(exc)}"}
            os.write(write_fd, json.dumps(result).encode() + b"\n")
            os._exit(0)
        os.close(write_fd)
        check.update(pid=pid, fd=read_fd, started=time.monotonic(), data=b"")
        self.running[pid] = check
        self.sel.register(read_fd, selectors.EVENT_READ, pid)

    def finish(self, pid: int, result: dict[str, Any] | None, kill: bool = False) -> None:
        """Reap a child (killing it first if asked); answer its check unless `result` is None."""
        check = self.running.pop(pid)
        self.sel.unregister(check["fd"])
        os.close(check["fd"])
        if kill:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if result is not None:
            self.reply({"id": check["id"], "seconds": round(time.monotonic() - check["started"], 3), **result})

    def on_child_data(self, pid: int) -> None:
        check = self.running[pid]
        chunk = os.read(check["fd"], 65536)
        if chunk:
            check["data"] += chunk
            return
        try:
            result = json.loads(check["data"])
        except ValueError:
            result = {"ok": False, "index": 0, "error": "the grammar converter crashed on it"}
        self.finish(pid, result)

    def on_command(self, line: str) -> None:
        command = json.loads(line)
        if "cancel" in command:
            self.waiting = deque(c for c in self.waiting if c["id"] != command["cancel"])
            pid = next((p for p, c in self.running.items() if c["id"] == command["cancel"]), None)
            if pid is not None:
                self.finish(pid, None, kill=True)
        else:
            self.waiting.append(command)

    def run(self) -> None:
        self.sel.register(self.commands.fd, selectors.EVENT_READ, None)
        pending = self.commands.buffer.split(b"\n")  # lines that came with the configuration line
        self.commands.buffer = pending.pop()
        for line in pending:
            if line.strip():
                self.on_command(line.decode())
        while True:
            while self.waiting and len(self.running) < self.max_parallel:
                self.start(self.waiting.popleft())
            for key, _ in self.sel.select(POLL_S if self.running else None):
                if key.data is None:
                    lines = self.commands.read()
                    if lines is None:  # the API process is gone
                        for pid in list(self.running):
                            self.finish(pid, None, kill=True)
                        return
                    for line in lines:
                        self.on_command(line)
                elif key.data in self.running:
                    self.on_child_data(key.data)
            for pid, check in list(self.running.items()):
                if cpu_seconds(pid) >= check["budget_s"]:
                    self.finish(pid, {"ok": False, "index": None, "error": None}, kill=True)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the server, which stops us
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import xgrammar as xgr  # noqa: PLC0415 - heavy (torch); only this process needs it

    commands = _Lines(sys.stdin.fileno())
    config = json.loads(commands.first())
    zygote = _Zygote(xgr, int(config.get("max_parallel", 1)), commands, bool(config.get("any_whitespace", True)))
    zygote.reply({"ready": True})
    zygote.run()


if __name__ == "__main__":
    main()
