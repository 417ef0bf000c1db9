"""moe-serve imports as moe_serve.* (pyproject's package-dir maps the folders kernels/, service/,
loadtest/ and bench/ there): beside PyPI's `kernels` (Hugging Face's kernel hub loader, which
transformers imports) both import, from any working directory."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.test_import_graph import imports_of

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "service", "loadtest", "bench")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

BOTH = """
import importlib.metadata, json
import kernels
import transformers.modeling_utils  # imports PyPI's kernels' hub API at import time
from transformers.utils.import_utils import is_kernels_available
import moe_serve.kernels.plugin.vllm_plugin, moe_serve.service.cli
print(json.dumps({"file": kernels.__file__, "get_kernel": callable(getattr(kernels, "get_kernel", None)),
                  "version": importlib.metadata.version("kernels"), "transformers_uses_it": is_kernels_available(),
                  "ours": moe_serve.kernels.__file__, "register": callable(moe_serve.kernels.plugin.vllm_plugin.register),
                  "cli": callable(moe_serve.service.cli.main)}))
"""


def test_pypi_kernels_and_ours_import_side_by_side(tmp_path: Path) -> None:
    """In a fresh interpreter started in an empty folder: `kernels` is PyPI's, at the version the
    test extra pins, transformers takes it, and our plugin and CLI import under moe_serve."""
    (pin,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["test"] if r.startswith("kernels==")]
    res = subprocess.run([sys.executable, "-c", BOTH], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["get_kernel"] and got["transformers_uses_it"], got
    assert got["version"] == pin.removeprefix("kernels=="), got
    assert Path(got["file"]).parent != REPO / "kernels" and "site-packages" in Path(got["file"]).parts, got
    assert Path(got["ours"]).parts[-2:] == ("kernels", "__init__.py") and got["ours"] != got["file"], got
    assert got["register"] and got["cli"], got


def test_every_package_of_the_folders_is_installed_under_moe_serve() -> None:
    """setuptools' find cannot add the moe_serve. prefix: pyproject lists the packages, and the
    list must match the tree (a new subpackage missing from it would be left out of the wheel):
    every folder with an __init__.py, and the data folders package-data reaches into
    ("configs/*.json" of moe_serve.kernels.moe: moe_serve.kernels.moe.configs)."""
    tool = PYPROJECT["tool"]["setuptools"]
    assert tool["package-dir"] == {f"moe_serve.{f}": f for f in FOLDERS}
    code = {".".join(("moe_serve", *init.parent.relative_to(REPO).parts))
            for f in FOLDERS for init in (REPO / f).rglob("__init__.py")}
    data = {f"{key}.{glob.split('/')[0]}" for key, globs in tool["package-data"].items() for glob in globs
            if "/" in glob and glob.split("/")[0].isidentifier()}
    assert set(tool["packages"]) == code | data
    assert {"moe_serve.kernels.plugin", "moe_serve.service", "moe_serve.kernels.moe.configs"} <= code | data
    assert all(key.split(".")[:2] in [["moe_serve", f] for f in FOLDERS] for key in tool["package-data"])
    project = PYPROJECT["project"]
    targets = [*project["scripts"].values(), *project["entry-points"]["vllm.general_plugins"].values()]
    assert targets and all(t.startswith("moe_serve.") for t in targets), targets


def test_nothing_imports_the_folders_by_their_bare_names() -> None:
    """From the checkout's root `import kernels` still finds the folder: a second copy of each
    module beside moe_serve.kernels' (or PyPI's kernels shadowed). No module or test may use it."""
    files = [p for f in (*FOLDERS, "tests") for p in sorted((REPO / f).rglob("*.py"))]
    bad = {str(p.relative_to(REPO)): sorted(found) for p in files
           if (found := {d for d in imports_of(p) if d.split(".")[0] in FOLDERS})}
    assert bad == {}
