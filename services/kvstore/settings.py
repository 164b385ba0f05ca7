"""The kv-store's settings (see `services.common.settings`)."""

from services.common.service_settings import Count, PositiveInt, ServiceSettings, SideChannelSettings
from services.common.settings import option


class KVStoreSettings(SideChannelSettings, ServiceSettings):
    ROLE = "kvstore"

    kv_store_ram_bytes: PositiveInt = option(1 << 30, "RAM tier size; least recently used blocks beyond it spill to "
                                             "disk", metavar="N", shown_default="1 GiB")
    kv_store_disk_bytes: Count = option(0, "disk tier size (0: no disk tier); least recently used blocks beyond it "
                                        "are dropped", metavar="N")
    kv_store_dir: str | None = option(None, "the disk tier's directory (needed with --kv-store-disk-bytes); a "
                                      "restart finds it again", metavar="DIR")
    transfer_host: str | None = option(None, "address the side channel listens on; keep it on the deployment's "
                                       "network only", metavar="ADDR", shown_default="--advertise-host's")
    transfer_advertise: str | None = option(None, "the address workers dial (needed when listening on 0.0.0.0)",
                                            metavar="ADDR")
