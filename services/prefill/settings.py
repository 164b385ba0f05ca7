"""A prefill worker's settings (see `services.common.settings`)."""

from services.common.service_settings import (
    EngineSettings,
    KVStoreTierSettings,
    LenderSettings,
    ModelSettings,
    PositiveInt,
    RoleSwitchSettings,
    ServiceSettings,
    SideChannelSettings,
    Transport,
)
from services.common.settings import option


class PrefillSettings(RoleSwitchSettings, LenderSettings, KVStoreTierSettings, EngineSettings, ModelSettings,
                      SideChannelSettings, ServiceSettings):
    ROLE = "prefill"

    max_concurrent_jobs: PositiveInt = option(8, "prefill jobs taken at once", metavar="N")
    kv_transport: Transport = option("auto", "how KV moves to decode workers (auto: shared memory when the decode "
                                     "worker is on this host, else TCP)")
