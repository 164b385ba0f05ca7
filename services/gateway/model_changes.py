"""The operator's model changes at the gateway (`ServeModel`, from the admin key only): which ones it refuses,
and how a model to serve is read (off the event loop: a tokenizer takes a while to load, and a known model's
name may be fetched into the cache first)."""

import asyncio
from collections.abc import Collection

from contracts import ServeModel, check_token
from services.gateway.model_info import ModelInfo
from shared.engine import resolve_model


def change_refused(command: ServeModel, served: Collection[str], namespaces: Collection[str]
                   ) -> tuple[str, str] | None:
    """(ServeModelReply code, why) when the gateway does not make the change; None when it tries. `served`: the
    models served now; `namespaces`: the namespaces their pools (and those of models being unserved) are in."""
    name = command.served_name
    if not command.serve:
        if name not in served:
            return "unknown_model", f"{name!r} is not served here (served: {', '.join(served)})"
        if len(served) == 1:
            return "last_model", f"{name!r} is the only model served here; serve another first"
        return None
    if name in served:
        return "already_served", f"{name!r} is served already"
    if not name or not command.model or not command.namespace:
        return "failed", "serving a model takes its served name, its model and its namespace"
    try:
        check_token(command.namespace, "namespace")
    except ValueError as exc:
        return "failed", str(exc)
    if command.namespace in namespaces:
        return "failed", (f"the namespace {command.namespace!r} is another model's: each model's scheduler and "
                          "workers need a namespace of their own")
    return None


def _load(model: str, served_name: str) -> ModelInfo:
    return ModelInfo.load(str(resolve_model(model).model_dir), served_name)


async def load_model_info(model: str, served_name: str) -> ModelInfo:
    """`model` (a model directory, or whatever --model takes) resolved as the gateway's own and read; raises
    (ModelLoadError, OSError, ...) saying why it cannot be."""
    return await asyncio.to_thread(_load, model, served_name)
