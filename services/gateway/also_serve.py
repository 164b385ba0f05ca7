"""`--also-serve NAME=MODEL@NAMESPACE`: a model the gateway routes besides its own `--model`, whose scheduler and
workers run in NAMESPACE (`contracts.model_namespace` names it for `up`'s models). Parsed here, written back by
`str()` (what `to_flags` renders), and checked together with the first model's name and namespace."""

from collections.abc import Iterable
from dataclasses import dataclass

from contracts import check_token


@dataclass(frozen=True, slots=True)
class AlsoServe:
    name: str  # the served name: requests' `model`
    model: str  # a model directory, or whatever --model takes (resolved as the gateway resolves its own)
    namespace: str  # where its scheduler and workers live

    def __str__(self) -> str:
        return f"{self.name}={self.model}@{self.namespace}"


def parse_also_serve(value) -> AlsoServe:
    """"NAME=MODEL@NAMESPACE" (NAME split at the first '=', NAMESPACE at the last '@') -> AlsoServe."""
    if isinstance(value, AlsoServe):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected NAME=MODEL@NAMESPACE, got {value!r}")
    name, equals, rest = value.partition("=")
    model, at, namespace = rest.rpartition("@")
    if not equals or not at or not name.strip() or not model.strip():
        raise ValueError(f"expected NAME=MODEL@NAMESPACE, got {value!r}")
    return AlsoServe(name.strip(), model.strip(), check_token(namespace.strip(), "namespace"))


def check_served_models(first_name: str | None, first_namespace: str, others: Iterable[AlsoServe]) -> None:
    """ValueError when two models share a served name or a namespace (each model's pools have one of their own);
    `first_name` None: not known yet (the model's own name, once resolved)."""
    names = [first_name] if first_name else []
    namespaces = [first_namespace]
    for other in others:
        if other.name in names:
            raise ValueError(f"the served model name {other.name!r} is given twice")
        if other.namespace in namespaces:
            raise ValueError(f"the namespace {other.namespace!r} of {other.name!r} is another model's: each model's "
                             "scheduler and workers need a namespace of their own")
        names.append(other.name)
        namespaces.append(other.namespace)
