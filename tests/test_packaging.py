"""What the project imports is what it declares: each package's third-party imports come from its distribution's
dependencies (or what they bring), so that the documented install (`pip install splitserve`, `[bench]` for
`splitserve bench`) is enough. Found by reading the imports, lazy ones included."""

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"shared", "services", "contracts", "loadtest"}
# The extras each part of the tree may rely on beyond the base dependencies.
EXTRAS = {"contracts": (), "shared": (), "services": ("trace-viewer", "bench"), "loadtest": ("bench", "grammar-compare")}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared(extras: tuple[str, ...]) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in extras:
        names |= {_name(r) for r in project["optional-dependencies"][extra]}
    brought = set()
    for name in names:  # what the declared ones require, one level down (fastapi brings pydantic and starlette)
        try:
            brought |= {_name(r) for r in metadata.requires(name) or [] if "extra ==" not in r}
        except metadata.PackageNotFoundError:
            pass
    return names | brought


def third_party_imports(package: str) -> dict[str, str]:
    """Top-level module imported -> a file importing it."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", sorted(EXTRAS))
def test_every_third_party_import_is_declared(package):
    distributions = metadata.packages_distributions()
    allowed = declared(EXTRAS[package])
    missing = {}
    for module, where in third_party_imports(package).items():
        names = {_name(d) for d in distributions.get(module, [module])}
        if not names & allowed:
            missing[module] = where
    assert not missing, f"imported but not declared for {package} (with extras {EXTRAS[package]}): {missing}"


def test_bench_without_its_extra_says_what_to_install(monkeypatch):
    import argparse

    from services.cli import bench

    real_find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "httpx" else real_find_spec(name, *a))
    args = argparse.Namespace(plot=None)
    assert bench.missing_extra(args) == ["httpx"]
    assert bench._with_extra(lambda args: 0)(args) == 2

