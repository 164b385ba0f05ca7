"""The product's rooms (issue 36), read from the source with `ast`:

- services use the engine through its public surface only (`from shared.engine import NAME`, NAME in `__all__`);
- services/common imports no specific service; no product module imports loadtest/;
- no import cycle among product modules. Every import counts, function-local and TYPE_CHECKING ones too: a
  cycle hidden in a function is still two modules that each need the other. `shared.engine`'s lazy names count
  as imports of the submodules that define them;
- no function is over 80 lines, but for the allow-listed ones below.

Tests and loadtest/ may import anything.
"""

import ast
import subprocess
import sys
from pathlib import Path

import shared.engine

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("services", "shared", "contracts")
MAX_FUNCTION_LINES = 80
# Functions allowed over the limit, each with its reason (none now): (path, qualified name).
LONG_FUNCTIONS_ALLOWED: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _product() -> dict[str, Path]:
    return {_module_name(p): p for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))}


MODULES = _product()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(module, names taken from it, line) for every import in the module, wherever it stands."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(ROOT)}:{line}"


def test_services_use_the_engine_surface():
    surface = set(shared.engine.__all__)
    wrong = []
    for name in MODULES:
        if not name.startswith("services."):
            continue
        for module, names, line in _imports(name):
            if module.startswith("shared.engine."):
                wrong.append(f"{_where(name, line)} imports {module}")
            elif module == "shared.engine" and not set(names) <= surface:
                wrong.append(f"{_where(name, line)} takes {sorted(set(names) - surface)} outside the surface")
    assert not wrong, "services import the engine only from shared.engine's surface:\n" + "\n".join(wrong)


def test_the_surface_resolves():
    for name in shared.engine.__all__:
        assert getattr(shared.engine, name) is not None, name


def test_the_light_surface_does_not_load_torch():
    # The gateway, the scheduler and the CLI take these; none of them needs torch for it.
    code = ("import sys\nfrom shared.engine import (Continuation, DEFAULT_BLOCK_SIZE, InvalidRequestError, "
            "SamplingParams, cacheable_block_hashes, resolve_model)\nassert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_common_imports_no_specific_service():
    wrong = [f"{_where(name, line)} imports {module}"
             for name in MODULES if name.startswith("services.common")
             for module, _, line in _imports(name)
             if module.startswith("services.") and not module.startswith("services.common")]
    assert not wrong, "services/common is shared by the services, so it imports none of them:\n" + "\n".join(wrong)


def test_the_product_imports_no_loadtest():
    wrong = [f"{_where(name, line)} imports {module}" for name in MODULES for module, _, line in _imports(name)
             if module == "loadtest" or module.startswith("loadtest.")]
    assert not wrong, "the product does not import the benchmarks:\n" + "\n".join(wrong)


def _graph() -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for name in MODULES:
        for module, names, _ in _imports(name):
            submodules = {f"{module}.{n}" for n in names} & MODULES.keys()
            # `from package import submodule` needs the submodule; any other name, the module itself.
            targets = submodules | ({module} if len(submodules) < max(len(names), 1) else set())
            graph[name] |= {t for t in targets if t in MODULES and t != name}
    for module in shared.engine._SURFACE:  # its lazy names
        graph["shared.engine"].add(f"shared.engine.{module}")
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other (directly or around a loop):\n" + "\n".join(map(str, cycles))


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, line count) of every function, methods and nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_functions_are_short():
    long = {(str(MODULES[name].relative_to(ROOT)), qualname): lines
            for name, tree in TREES.items() for qualname, lines in _functions(tree) if lines > MAX_FUNCTION_LINES}
    over = [f"{path} {qualname}: {lines} lines" for (path, qualname), lines in sorted(long.items())
            if (path, qualname) not in LONG_FUNCTIONS_ALLOWED]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(over)
    stale = LONG_FUNCTIONS_ALLOWED - set(long)
    assert not stale, f"allowed to be long but no longer are (drop them from the list): {sorted(stale)}"
