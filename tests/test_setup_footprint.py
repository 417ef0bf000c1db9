"""What `service/setup.sh --test` leaves running on the machine: no Prometheus and no node
exporter listening that the tests did not start themselves. (The Debian package would start its
system service and pull in a node exporter on :9100; setup.sh installs it with service starts
denied, its unit disabled and without recommends, and kills nothing.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MONITORING_DAEMONS = {"prometheus", "prometheus-node-exporter", "node_exporter"}
LISTEN = "0A"  # TCP state in /proc/net/tcp*


def _listening_inodes() -> dict[str, int]:
    """Socket inode -> port of every listening TCP socket in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                out[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return out


def _ports(pid: int, inodes: dict[str, int]) -> set[int] | None:
    """Ports `pid` listens on; None where its descriptors are not readable (another user's
    process without CAP_SYS_PTRACE, e.g. in a container): then it counts as listening."""
    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except PermissionError:
        return None
    return {inodes[link[8:-1]] for link in links if link.startswith("socket:[") and link[8:-1] in inodes}


def _program(cmdline: list[str]) -> str:
    return Path(cmdline[0]).name if cmdline else ""


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        status = Path(f"/proc/{pid}/status").read_text()
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return seen


def test_no_monitoring_daemon_listens_that_the_tests_did_not_start(tmp_path_factory: pytest.TempPathFactory) -> None:
    test_temp_root = str(tmp_path_factory.getbasetemp().parent)  # this and other pytest runs' Prometheus
    inodes = _listening_inodes()
    strays = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            cmdline = [arg.decode(errors="replace") for arg in (proc / "cmdline").read_bytes().split(b"\0") if arg]
            if _program(cmdline) not in MONITORING_DAEMONS:
                continue
            pid = int(proc.name)
            if os.getpid() in _ancestors(pid) or any(test_temp_root in arg for arg in cmdline):
                continue  # the tests' own Prometheus
            ports = _ports(pid, inodes)
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        if ports is None or ports:
            strays.append(f"pid {pid} ({' '.join(cmdline)}) listening on {sorted(ports) if ports else 'unreadable'}")
    assert not strays, f"monitoring daemons the tests did not start: {strays}"
