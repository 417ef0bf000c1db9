"""The packages' shape: no import cycle among service/, kernels/, loadtest/ modules (imports in
functions and under TYPE_CHECKING included), and no module over 400 lines.

KNOWN_* would list accepted exceptions (none today); an entry that no longer holds fails the
test too, so the lists cannot go stale."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "kernels", "loadtest", "bench")
MAX_LINES = 400
KNOWN_CYCLES: list[set[str]] = []
KNOWN_LONG: set[str] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = ("moe_serve", *f.relative_to(REPO).with_suffix("").parts)
            out[".".join(parts[:-1] if f.stem == "__init__" else parts)] = f
    return out


def imports_of(path: Path) -> set[str]:
    """Every module name an import anywhere in path names (`from a import b` gives a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (`from pkg import mod` too)."""
    mods = _modules()
    return {name: {m for m in imports_of(path) if m in mods and m != name and mods[m].stem != "__init__"}
            for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or w != v:
                w = stack.pop()
                comp.add(w)
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    found = cycles(_graph())
    assert [c for c in found if c not in KNOWN_CYCLES] == [], found
    assert [c for c in KNOWN_CYCLES if c not in found] == [], "a known cycle is gone: remove it from KNOWN_CYCLES"


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)) for p in _modules().values() if len(p.read_text().splitlines()) > MAX_LINES}
    assert long - KNOWN_LONG == set(), long
    assert KNOWN_LONG - long == set(), "a known long module got short: remove it from KNOWN_LONG"


def test_the_hooks_look_their_choices_up_in_the_layer_plan() -> None:
    """Every MoE hook imports kernels/plugin/layer_plan.py, and no module of kernels/ or service/
    but the plan asks kernels/moe/selection.py for a route or a whole decision."""
    import re

    graph = _graph()
    for hook in ("moe_serve.kernels.plugin.moe_hook", "moe_serve.kernels.plugin.router_hook", "moe_serve.kernels.plugin.layer_warmup"):
        assert "moe_serve.kernels.plugin.layer_plan" in graph[hook], hook
    asks = re.compile(r"selection\.(route|route_choice|choose|describe|ranges)\(|routing\.policy\(")
    deciding = {name for name, path in _modules().items() if name.split(".")[1] in ("kernels", "service")
                and asks.search(path.read_text())}
    assert deciding - {"moe_serve.kernels.moe.selection"} == {"moe_serve.kernels.plugin.layer_plan"}, deciding


def test_no_moe_serve_setting_is_read_from_the_environment_outside_the_config() -> None:
    """kernels/ reads its MOE_SERVE_* settings through kernels/config.py; the environment only
    for the process plumbing that module's docstring names."""
    import re

    plumbing = ("ENABLE_ENV", "PINS_WARNED_ENV", "RUNTIME_DIR_ENV")
    read = re.compile(r"os\.environ\.get\(([^),]+)|os\.getenv\(([^),]+)|os\.environ\[([^\]]+)\](?!\s*=[^=])")
    found = {}
    for name, path in _modules().items():
        if name.startswith("moe_serve.kernels.") and name != "moe_serve.kernels.config":
            keys = [next(g for g in m.groups() if g).strip() for m in read.finditer(path.read_text())]
            ours = [k for k in keys if "MOE_SERVE" in k or (k.endswith("ENV") and k not in plumbing)]
            if ours:
                found[name] = ours
    assert found == {}, found
