"""docs/architecture.md against the tree: its module tables list exactly the modules there are,
the kernels/ layers it names hold (no module imports a later layer, lazy imports included), the
package rule holds, and every module that imports vLLM (or names a vLLM module to import) is in
its "Where vLLM is imported" section."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_import_graph import imports_of

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "architecture.md").read_text()
PACKAGES = ("service", "kernels", "loadtest", "bench")
VLLM_MODULE_NAME = re.compile(r"^vllm(\.\w+){2,}$")   # 'vllm.model_executor.layers.fused_moe'


def section(title: str) -> str:
    """The text under a heading that starts with `title`, up to the next heading of its level."""
    m = re.search(rf"^(#+) {re.escape(title)}.*$", DOC, flags=re.M)
    assert m, f"no heading {title!r} in architecture.md"
    level = len(m.group(1))
    rest = DOC[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def table_rows(text: str) -> list[list[str]]:
    """The cells of each table row below the header separator."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.strip().startswith("|")]
    return [r for r in rows[2:] if r]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def tree_modules(pkg: str) -> set[str]:
    return {str(p.relative_to(REPO / pkg)) for p in (REPO / pkg).rglob("*.py")}


def listed(pkg: str) -> tuple[set[str], list[tuple[str, str]]]:
    """Modules the package's table lists (paths inside the package), and (layer, module) rows."""
    rows = table_rows(section(f"{pkg}/"))
    mods: set[str] = set()
    layered: list[tuple[str, str]] = []
    layer = ""
    for row in rows:
        if pkg == "kernels":
            layer = row[0] or layer
            cell = row[1]
        else:
            cell = row[0]
        for name in ticked(cell):
            mods.add(name)
            layered.append((layer, name))
    return mods, layered


def module_name(pkg: str, rel: str) -> str:
    parts = Path("moe_serve", pkg, rel).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_listed_module_exists_and_every_module_is_listed(pkg: str) -> None:
    mods, _ = listed(pkg)
    tree = tree_modules(pkg)
    assert mods - tree == set(), f"architecture.md lists modules {pkg}/ does not have"
    unlisted = {m for m in tree - mods if Path(m).name != "__init__.py"}
    assert unlisted == set(), f"modules of {pkg}/ missing from architecture.md"


def test_around_them_paths_exist() -> None:
    for row in table_rows(section("Around them")):
        for path in ticked(row[0]):
            assert (REPO / path).exists(), path


def test_kernels_layers_hold() -> None:
    """A kernels module imports kernels modules of its own layer or of the layers above only."""
    _, layered = listed("kernels")
    order = list(dict.fromkeys(layer for layer, _ in layered))
    layer_of = {module_name("kernels", m): order.index(layer) for layer, m in layered}
    assert len(order) >= 4 and len(layer_of) == len(layered)
    broken = []
    for layer, rel in layered:
        name = module_name("kernels", rel)
        for dep in imports_of(REPO / "kernels" / rel):
            if dep in layer_of and layer_of[dep] > layer_of[name]:
                broken.append(f"{name} ({order[layer_of[name]]}) imports {dep} ({order[layer_of[dep]]})")
    assert broken == []


def test_layer_checker_sees_a_break(tmp_path: Path) -> None:
    """The checks above read imports anywhere in a module, lazy ones included."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from moe_serve.kernels.plugin import vllm_compat\n    import moe_serve.kernels.moe.smem\n")
    assert {"moe_serve.kernels.plugin.vllm_compat", "moe_serve.kernels.moe.smem"} <= imports_of(f)


def test_package_rule() -> None:
    """kernels imports neither service, loadtest nor bench; loadtest imports no service or bench
    module; service imports bench only in cli.py (the `moe-serve bench` subcommand)."""
    for pkg, banned in (("kernels", ("service", "loadtest", "bench")), ("loadtest", ("service", "bench")),
                        ("service", ("bench",))):
        for rel in tree_modules(pkg):
            bad = {d for d in imports_of(REPO / pkg / rel) if d.split(".")[0] == "moe_serve" and d.split(".")[1:2] in [[b] for b in banned]}
            assert bad == set() or (pkg, rel) == ("service", "cli.py"), f"{pkg}/{rel} imports {bad}"


def names_vllm(path: Path) -> bool:
    """path imports vLLM, or holds a vLLM module path as a string (imported by name)."""
    tree = ast.parse(path.read_text())
    if any(d == "vllm" or d.startswith("vllm.") for d in imports_of(path)):
        return True
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and VLLM_MODULE_NAME.match(n.value)
               for n in ast.walk(tree))


def test_every_module_that_imports_vllm_is_named() -> None:
    named = set(ticked(section("Where vLLM is imported")))
    using = {f"{pkg}/{rel}" for pkg in PACKAGES for rel in tree_modules(pkg) if names_vllm(REPO / pkg / rel)}
    assert {"kernels/plugin/vllm_compat.py", "kernels/moe/vllm_kernels.py", "service/engine.py"} <= using
    assert using - named == set(), "modules using vLLM that architecture.md does not name"
    assert all((REPO / p).exists() for p in named if p.endswith(".py"))


def test_the_request_path_names_real_modules() -> None:
    text = section("One request, end to end")
    paths = {p for p in ticked(text) if p.endswith(".py")}
    assert len(paths) >= 20
    assert [p for p in paths if not (REPO / p).is_file()] == []
