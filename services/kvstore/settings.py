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
    kv_store_max_put_bytes: PositiveInt = option(512 << 20, "a put declaring more bytes of blocks is refused before "
                                                 "anything is sent", metavar="N", shown_default="512 MiB")
    kv_store_max_put_bytes_in_flight: PositiveInt = option(1 << 30, "the bytes of all puts being received at once; "
                                                           "past them a put is refused until some are stored",
                                                           metavar="N", shown_default="1 GiB")
    transfer_host: str | None = option(None, "address the side channel listens on; keep it on the deployment's "
                                       "network only", metavar="ADDR", shown_default="--advertise-host's")
    transfer_advertise: str | None = option(None, "the address workers dial (needed when listening on 0.0.0.0)",
                                            metavar="ADDR")
