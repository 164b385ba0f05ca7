"""A decode worker's settings (see `services.common.settings`)."""

from typing import Literal

from services.common.service_settings import (
    BorrowerSettings,
    EngineSettings,
    KVStoreTierSettings,
    ModelSettings,
    PositiveInt,
    PositiveSeconds,
    RoleSwitchSettings,
    AnyPort,
    NonNegative,
    Seconds,
    ServiceSettings,
    SideChannelSettings,
)
from services.common.settings import option


class DecodeSettings(RoleSwitchSettings, BorrowerSettings, KVStoreTierSettings, EngineSettings, ModelSettings,
                     SideChannelSettings, ServiceSettings):  # --help lists the bases' flags last first, so the bus's lead
    ROLE = "decode"

    mode: Literal["colocated", "disagg"] = option("colocated", "colocated: prefills every request itself; disagg: "
                                                  "long prompts are prefilled remotely")
    max_active_requests: PositiveInt = option(512, "running plus queued requests taken at most", metavar="N")
    kv_receiver_host: str | None = option(None, "address the KV side channel listens on (disagg mode)",
                                          metavar="ADDR", shown_default="--advertise-host's")
    kv_receiver_port: AnyPort = option(0, "the KV side channel's port (0: any free port)", metavar="PORT")
    kv_receiver_advertise: str | None = option(None, "the address prefill workers dial (needed when listening on "
                                               "0.0.0.0)", metavar="ADDR")
    prefill_timeout: PositiveSeconds = option(30.0, "seconds a remote prefill (first token and KV) may take before "
                                              "the worker prefills locally", metavar="S")
    drain_timeout: Seconds = option(5.0, "on SIGTERM, seconds the worker's running requests may go on before it "
                                    "hands them back to their gateways, which move them to other workers",
                                    metavar="S")
    # Bursts reach an idle worker in parts some 10 ms apart (services.common.engine_loop).
    gather_ms: NonNegative = option(50.0, "an idle worker's first step waits this long at most for the rest of a "
                                    "burst of requests (0: never)", metavar="MS")
