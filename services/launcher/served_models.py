"""A deployment's models beyond its first, as the plan takes them (`FurtherModel`), and the checks every model's
settings pass.

The first model's pools live in the deployment's namespace under today's names (`decode-0`, ...); every further
model's scheduler, workers and kv-store live in a namespace of their own (`contracts.model_namespace`), so a
worker's credential reaches only its model's subjects, and its instances' names carry its prefix, `mK-` for the
K-th model (`m1-decode-0`): names stay distinct across the deployment (logs, credentials, the supervisor's
children). A further model takes up's settings but for its own keys (`ModelSpec`); what only the first model has
(an explicit --layer-split, a prefill pipeline, role switching, the SLO planner, --chat-template) it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts import model_namespace
from services.launcher.model_spec import ModelSpec, ModelSpecError
from services.launcher.up_settings import UpSettings


@dataclass(frozen=True)
class FurtherModel:
    """A model served beside the first: `up` is up's settings with its own (its namespace and served name
    included)."""

    up: UpSettings
    model_dir: str
    prefix: str  # its instances' names begin with it
    cpus: tuple[int, ...] | None = None  # its own CPU list; None: it shares up's with the other models
    stage_ranges: tuple[tuple[int, int], ...] = ()  # its pipeline's layers per stage

    @property
    def served_name(self) -> str:
        assert self.up.served_model_name is not None
        return self.up.served_model_name

    @property
    def namespace(self) -> str:
        return self.up.namespace


def model_prefix(index: int) -> str:
    """The K-th further model's instance name prefix (the first model, index 0, has none)."""
    return f"m{index}-" if index else ""


def further_settings(up: UpSettings, spec: ModelSpec, served_name: str) -> UpSettings:
    """up's settings as the further model `spec`, served as `served_name`, runs: its own keys, else up's; what only
    the first model has left out; a pipeline's stages up's only where this model is a pipeline too."""
    own = spec.own()
    topology = own.get("topology", up.topology)
    inherited_stages = up.stages if topology == "pipeline" and up.topology == "pipeline" else None
    settings = up.model_copy(update={
        "models": (ModelSpec(model=spec.model),), "served_model_name": served_name,
        "namespace": model_namespace(up.namespace, served_name), "topology": topology,
        "dtype": own.get("dtype", up.dtype), "decode": own.get("decode", up.decode),
        "prefill": own.get("prefill", up.prefill), "stages": own.get("stages", inherited_stages),
        "kv_store": own.get("kv_store", up.kv_store), "cpus": own.get("cpus", up.cpus),
        "kv_stores": own.get("kv_stores", up.kv_stores),
        "layer_split": None, "prefill_stages": None, "role_switch": False, "planner": "none", "chat_template": None})
    if "kv_stores" not in own and not settings.runs_kv_store:  # up's count is for kv-stores this model has none of
        settings = settings.model_copy(update={"kv_stores": 1})
    return settings


def check_topology(o: UpSettings) -> None:
    """ValueError unless the topology can run as asked (pool sizes, stages, role switching)."""
    if o.prefill_stages is not None and (o.topology != "disagg" or o.prefill != 1):
        raise ValueError("--prefill-stages makes disagg's prefill pool one pipeline: it needs --topology disagg "
                         "and --prefill 1")
    if (o.stages is not None or o.layer_split is not None) and o.topology != "pipeline" and o.prefill_stages is None:
        flag = "--stages" if o.stages is not None else "--layer-split"
        raise ValueError(f"{flag} splits a pipeline's layers: it needs --topology pipeline (or, in disagg, "
                         f"--prefill-stages); this is --topology {o.topology}")
    if o.role_switch and (o.topology != "disagg" or o.prefill_stages is not None):
        raise ValueError("--role-switch switches workers between disagg's prefill and decode pools: it needs "
                         "--topology disagg without --prefill-stages")
    if o.stages is not None and o.layer_split is not None:
        raise ValueError("give --stages or --layer-split, not both")
    if o.kv_stores > 1 and not o.runs_kv_store:
        raise ValueError(f"--kv-stores {o.kv_stores} asks for kv-stores where none runs: add --kv-store")


def pipelined(o: UpSettings) -> bool:
    """Whether some of the model's workers are pipeline stages."""
    return o.topology == "pipeline" or (o.topology == "disagg" and o.prefill_stages is not None)


def pipeline_split(o: UpSettings, model_dir: str) -> tuple[tuple[int, int], ...]:
    """The pipeline's layer ranges, checked against the model (ValueError if they do not fit it)."""
    from shared.engine import LayerSplitError, ModelLoadError, even_split, model_layer_count, parse_layer_split

    stages = o.prefill_stages if o.topology == "disagg" else o.stages
    try:
        num_layers = model_layer_count(model_dir)
    except ModelLoadError as exc:
        raise ValueError(str(exc)) from None
    try:
        if o.layer_split is not None:
            ranges = parse_layer_split(o.layer_split, num_layers)
        else:
            ranges = even_split(num_layers, 2 if stages is None else stages)
    except LayerSplitError as exc:
        raise ValueError(f"bad pipeline split for a model of {num_layers} layers: {exc}") from None
    if len(ranges) < 2:
        raise ValueError("a pipeline needs at least 2 stages")
    return tuple((r.start, r.end) for r in ranges)


def further_model(up: UpSettings, spec: ModelSpec, index: int, model_dir: str, served_name: str) -> FurtherModel:
    """The `index`-th further model as the plan takes it, its model resolved to `model_dir`; ValueError
    (ModelSpecError) saying what cannot run."""
    if "=" in served_name:
        raise ModelSpecError(f"a served name may not hold '=' (the gateway's --also-serve NAME=MODEL@NAMESPACE): "
                             f"{served_name!r}")
    settings = further_settings(up, spec, served_name)
    try:
        check_topology(settings)
        ranges = pipeline_split(settings, model_dir) if pipelined(settings) else ()
    except ValueError as exc:
        raise ModelSpecError(f"model {served_name!r}: {exc}") from None
    from services.common.cpus import worker_cpus

    cpus = worker_cpus(spec.cpus) if spec.cpus is not None else None
    return FurtherModel(settings, model_dir, model_prefix(index), cpus, ranges)
