"""A pipeline stage's settings (see `services.common.settings`); with `--layers 0:N`, the pipeline's head's."""

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, PlainSerializer

from services.common.service_settings import (
    Count,
    EngineSettings,
    ModelSettings,
    PositiveInt,
    PositiveSeconds,
    Seconds,
    ServiceSettings,
    SideChannelSettings,
    Transport,
)
from services.common.settings import default_of, option
from services.decode.settings import DecodeSettings
from services.prefill.settings import PrefillSettings
from shared.engine import DEFAULT_MICROBATCHES, DEFAULT_STEP_TIMEOUT_S, LayerRange


def _layer_range(value: Any) -> Any:
    if isinstance(value, str):
        try:
            start, end = (int(v) for v in value.split(":"))
        except ValueError:
            raise ValueError(f"{value!r} is not a layer range START:END, e.g. 0:6") from None
        return LayerRange(start, end)
    return value


def _layer_text(layers: LayerRange) -> str:
    return f"{layers.start}:{layers.end}"


def _stage_list(value: Any) -> Any:
    if isinstance(value, str):
        value = [stage.strip() for stage in value.split(",") if stage.strip()]
        if not value:
            raise ValueError("name at least one stage")
    return value


class StageSettings(EngineSettings, ModelSettings, SideChannelSettings, ServiceSettings):
    ROLE = "stage"

    layers: Annotated[LayerRange, BeforeValidator(_layer_range), PlainSerializer(_layer_text)] = option(
        ..., "this stage's layers START:END; a stage from 0 is the head (it takes the requests)", metavar="START:END")
    stages: Annotated[list[str], BeforeValidator(_stage_list)] | None = option(
        None, "head only: the instance ids of the stages after it, in layer order", metavar="ID,ID,...")
    microbatches: PositiveInt = option(DEFAULT_MICROBATCHES, "head only: steps in flight at once", metavar="M")
    step_timeout: PositiveSeconds = option(DEFAULT_STEP_TIMEOUT_S, "head only: seconds a step may take through the "
                                           "pipeline before its requests fail", metavar="S")
    stage_wait: PositiveSeconds = option(300.0, "head only: seconds to wait at start for the stages to be ready",
                                         metavar="S")
    head_role: Literal["decode", "prefill"] = option("decode", "head only: what the pipeline serves: requests "
                                                     "(decode: the pipeline topology) or prefill jobs (a pipelined "
                                                     "prefill pool in the disagg topology)")
    max_active_requests: PositiveInt = option(default_of(DecodeSettings, "max_active_requests"),
                                              "decode head: requests taken at most", metavar="N")
    drain_timeout: Seconds = option(default_of(DecodeSettings, "drain_timeout"), "decode head: on SIGTERM, seconds "
                                    "the pipeline's running requests may go on before it hands them back to their "
                                    "gateways, which move them to other workers", metavar="S")
    max_concurrent_jobs: PositiveInt = option(default_of(PrefillSettings, "max_concurrent_jobs"),
                                              "prefill head: prefill jobs taken at once", metavar="N")
    ships_kv: bool = option(False, "stages of a prefill pipeline: keep the KV cache where the side channel reads it "
                            "in place (shared memory), as each stage ships its own layers' KV to decode workers")
    kv_transport: Transport = option(default_of(PrefillSettings, "kv_transport"), "prefill pipelines: how the head "
                                     "and the stages ship KV to decode workers")
    num_kv_blocks: PositiveInt | None = option(None, "stages after the head: KV blocks; the head takes the smallest "
                                               "of its stages' counts and its own", metavar="N",
                                               shown_default="what --kv-cache-bytes holds")
    inline_activation_bytes: Count = option(256 << 10, "activations up to this size ride NATS; bigger ones go over "
                                            "the side channel", metavar="N", shown_default="256 KiB")
    activation_transport: Transport = option("auto", "the side channel's backend for big activations")
    transfer_host: str | None = option(None, "address this stage's side channel listens on", metavar="ADDR",
                                       shown_default="--advertise-host's")
    transfer_advertise: str | None = option(None, "the address other stages dial (needed when listening on "
                                            "0.0.0.0)", metavar="ADDR")
