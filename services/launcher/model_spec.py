"""One model of a deployment as `splitserve up` is asked for it: `--model MODEL[:KEY=VALUE,...]`, an item of
`models:` in `up --config FILE`, or `splitserve models serve NAME --model MODEL KEY=VALUE ...`. Pure.

The first model takes `up`'s own settings (`--topology`, `--decode`, `--served-model-name`, ...); every later one
may give its own of the keys below, each defaulting to `up`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from services.common.service_settings import Dtype, PositiveInt

Topology = Literal["colocated", "disagg", "pipeline"]


def usable_cpus(spec: str) -> str:
    """A CPU list (or auto|none) this process may use; ValueError naming the CPUs it may not."""
    from services.common.cpus import worker_cpus

    worker_cpus(spec)
    return spec


UsableCpus = Annotated[str, AfterValidator(usable_cpus)]


class ModelSpecError(ValueError):
    """A model spec that cannot be served, with the reason for the operator."""


class ModelSpec(BaseModel):
    """A model and its own settings; None: `up`'s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)  # a known model's name, a Hugging Face directory or a .gguf file
    name: str | None = Field(None, min_length=1)  # the served name (default: the model's own)
    dtype: Dtype | None = None
    topology: Topology | None = None
    decode: PositiveInt | None = None
    prefill: PositiveInt | None = None
    stages: PositiveInt | None = None  # a pipeline's, split evenly
    kv_store: bool | None = None
    cpus: UsableCpus | None = None  # its own CPU list (otherwise the models' workers share up's)

    def own(self) -> dict[str, Any]:
        """The keys given, without the model."""
        return {key: value for key, value in self.model_dump(exclude={"model"}).items() if value is not None}


KEYS = tuple(name for name in ModelSpec.model_fields if name != "model")


def spec_of(model: str, keys: dict[str, Any], said: str) -> ModelSpec:
    """A ModelSpec of `model` and its keys (dashes or underscores); ModelSpecError naming `said` (where it came
    from) and the first bad key."""
    keys = {str(key).replace("-", "_"): value for key, value in keys.items()}
    unknown = sorted(set(keys) - set(KEYS))
    if unknown:
        raise ModelSpecError(f"{said}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    try:
        return ModelSpec(model=model, **keys)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "model"
        raise ModelSpecError(f"{said}: {where}: {error['msg']} (got {error.get('input')!r})") from None


def parse_keys(items: Iterable[str], said: str) -> dict[str, str]:
    """["decode=2", "cpus=0", "1"] -> {"decode": "2", "cpus": "0,1"}: a part without '=' goes on with the value
    before it (a CPU list's commas). ModelSpecError on a part that is not KEY=VALUE."""
    keys: dict[str, str] = {}
    last = None
    for part in items:
        key, eq, value = part.partition("=")
        if not eq:
            if last is None or not part:
                raise ModelSpecError(f"{said}: {part!r} is not KEY=VALUE (e.g. decode=2)")
            keys[last] += "," + part
            continue
        key = key.strip().replace("-", "_")
        if not key or key in keys:
            raise ModelSpecError(f"{said}: " + (f"{key} is given twice" if key else f"{part!r} is not KEY=VALUE"))
        keys[key], last = value.strip(), key
    return keys


def parse_model_spec(text: str) -> ModelSpec:
    """`MODEL[:KEY=VALUE,...]` (split at the first ':'; a comma inside a value, as in cpus=0,1, is kept)."""
    model, _, keys = text.partition(":")
    said = f"--model {text}"
    if not model:
        raise ModelSpecError(f"{said}: no model before ':'")
    return spec_of(model, parse_keys(keys.split(",") if keys else [], said), said)


def model_specs(value: Any) -> tuple[ModelSpec, ...]:
    """`up`'s models from a flag's, a variable's or a config file's value: MODEL[:KEY=VALUE,...] strings,
    {model: ..., KEY: VALUE} mappings, or a list of either (ValueError, for the settings' validation, on a bad
    one). The first model takes up's own settings: it may carry no keys."""
    items = [value] if isinstance(value, (str, dict, ModelSpec)) else list(value or ())
    specs = []
    for item in items:
        if isinstance(item, ModelSpec):
            specs.append(item)
        elif isinstance(item, str):
            specs.append(parse_model_spec(item))
        elif isinstance(item, dict) and isinstance(item.get("model"), str):
            specs.append(spec_of(item["model"], {k: v for k, v in item.items() if k != "model"},
                                 f"model {item['model']}"))
        else:
            raise ModelSpecError(f"a model is MODEL[:KEY=VALUE,...] or {{model: MODEL, KEY: VALUE}}, not {item!r}")
    if specs and specs[0].own():
        raise ModelSpecError(f"the first model ({specs[0].model}) takes up's own settings (--decode, "
                             f"--served-model-name, ...), not keys: give {', '.join(specs[0].own())} there")
    return tuple(specs)


def check_served_names(names: list[str]) -> None:
    """ModelSpecError unless every model is served under a name of its own."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ModelSpecError(f"two models are served as {name!r}: give one another name (name=...)")
        seen.add(name)
