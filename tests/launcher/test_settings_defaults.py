"""Every setting's default is written once, in its settings class (issue 36): no product module restates it as a
function parameter's default, a class field's default or a flag's `add_argument("--name", default=...)`, and no two
settings classes write the same field's default as a literal each.

A name matches a setting's field name (`_s` dropped: `drain_timeout_s` is `drain_timeout` in seconds). Values too
common to mean anything (None, False, True, 0, "", empty containers) are left out: a parameter
`timeout: float | None = None` restates no setting. `UNRELATED` names the few parameters that share a setting's
name and value by coincidence.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import services
from launcher_helpers import ROOT
from services.common.settings import Settings

PRODUCT = ("services", "shared", "contracts")
TRIVIAL = (None, False, True, 0, "", (), [], {})
# (module, parameter): why its default is not the setting of that name.
UNRELATED = {
    ("services/common/free_port.py", "host"): "a free port on loopback, not the gateway's address",
    ("services/launcher/nats_server.py", "host"): "the embedded NATS server listens on loopback",
    ("shared/transfer/receiver.py", "host"): "a side channel's address, given by every caller",
    ("shared/transfer/shm.py", "device"): "shared memory is host memory, whatever the worker's device",
}
_OPERATORS = (ast.LShift, ast.Mult, ast.Add, ast.Sub, ast.Pow, ast.USub)


def _settings_classes() -> list[type[Settings]]:
    """Every Settings subclass, once every settings module is imported."""
    for info in pkgutil.iter_modules(services.__path__):
        try:
            importlib.import_module(f"services.{info.name}.settings")
        except ModuleNotFoundError:
            pass
    importlib.import_module("services.launcher.up_settings")
    found, todo = [], [Settings]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


SETTINGS_NAMES = {"Settings"} | {cls.__name__ for cls in _settings_classes()}


def _is_trivial(value) -> bool:
    return any(type(value) is type(t) and value == t for t in TRIVIAL)


def setting_defaults() -> dict[str, list]:
    """field name -> the non-trivial defaults settings classes give it."""
    defaults: dict[str, list] = {}
    for cls in _settings_classes():
        for name, field in cls.model_fields.items():
            if not field.is_required() and not _is_trivial(field.default) and field.default_factory is None:
                if field.default not in defaults.setdefault(name, []):
                    defaults[name].append(field.default)
    return defaults


def literal(node: ast.AST | None):
    """The value of a literal expression (constants, tuples, `1 << 30`, `-1`), else Ellipsis."""
    if node is None:
        return ...
    if all(isinstance(n, (ast.Constant, ast.Tuple, ast.BinOp, ast.UnaryOp, ast.expr_context, *_OPERATORS))
           for n in ast.walk(node)):
        return eval(compile(ast.Expression(node), "<literal>", "eval"))  # constants only: nothing to run
    return ...


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else None
    return getattr(func, "id", None) or getattr(func, "attr", "")


def _field_default(value: ast.AST | None) -> ast.AST | None:
    """A class field's written default: the value itself, or `option(X)` / `Field(X)` / `field(default=X)`'s X."""
    if isinstance(value, ast.Call) and _call_name(value) in ("option", "Field", "field"):
        keyword = next((k.value for k in value.keywords if k.arg == "default"), None)
        return value.args[0] if value.args else keyword
    return value


def _bases(node: ast.ClassDef) -> set[str]:
    return {getattr(b, "id", None) or getattr(b, "attr", "") for b in node.bases}


def written_defaults(tree: ast.AST):
    """(kind, name, value node, line) of each default written in a module: parameters' and class fields'."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
                yield "parameter", arg.arg, default, default.lineno
            for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                if default is not None:
                    yield "parameter", arg.arg, default, default.lineno
        elif _call_name(node) == "add_argument" and node.args and isinstance(node.args[0], ast.Constant):
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if default is not None and str(node.args[0].value).startswith("--"):
                yield "flag", node.args[0].value[2:].replace("-", "_"), default, node.lineno
        elif isinstance(node, ast.ClassDef):
            kind = "setting" if _bases(node) & SETTINGS_NAMES else "field"
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    yield kind, item.target.id, _field_default(item.value), item.lineno


def _normal(name: str) -> str:
    """`drain_timeout_s` is `drain_timeout`'s value in seconds."""
    return name.removesuffix("_s")


def _product_files() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py"))


def find_repeats(files: list[Path]) -> list[str]:
    defaults = setting_defaults()
    repeats, homes = [], {}
    for path in files:
        for kind, name, node, line in written_defaults(ast.parse(path.read_text(), str(path))):
            value = literal(node)
            if value is ... or _is_trivial(value) or value not in defaults.get(_normal(name), []):
                continue
            module = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name)
            if (module, name) in UNRELATED:
                continue
            where = f"{module}:{line}"
            if kind == "setting":
                homes.setdefault((name, repr(value)), []).append(where)
            else:
                repeats.append(f"{where}: {kind} {name} = {value!r} restates a setting's default")
    for (name, value), places in homes.items():
        if len(places) > 1:
            repeats.append(f"settings field {name} = {value} written as a literal in {len(places)} places: "
                           + ", ".join(places))
    return repeats


def test_no_setting_default_is_written_twice():
    repeats = find_repeats(_product_files())
    assert not repeats, "\n".join(repeats)


def test_the_check_finds_a_restated_default(tmp_path):
    module = tmp_path / "restates.py"
    module.write_text("def connect(namespace: str = 'splitserve', device='cpu', timeout=None):\n    pass\n\n"
                      "class Plan:\n    router: str = 'kv'\n")
    repeats = find_repeats([module])
    assert [r.split(": ", 1)[1] for r in repeats] == [
        "parameter namespace = 'splitserve' restates a setting's default",
        "parameter device = 'cpu' restates a setting's default",
        "field router = 'kv' restates a setting's default"]


def test_the_check_finds_a_default_two_settings_classes_write(tmp_path):
    module = tmp_path / "twice.py"
    module.write_text("class GatewayServiceSettings(BusSettings):\n    port: int = option(8000, 'its port')\n\n"
                      "class UpSettings(Settings):\n    port: int = option(8000, 'the gateway port')\n")
    assert find_repeats([module]) == ["settings field port = 8000 written as a literal in 2 places: twice.py:2, "
                                      "twice.py:5"]


def test_literals_are_read_and_expressions_are_not():
    assert literal(ast.parse("1 << 30", mode="eval").body) == 1 << 30
    assert literal(ast.parse("(1, -2)", mode="eval").body) == (1, -2)
    assert literal(ast.parse("DEFAULT", mode="eval").body) is ...
    assert literal(ast.parse("f(1)", mode="eval").body) is ...
