"""The decode role as a switchable worker takes it on its loaded engine (`services.common.role_switch`): from the
worker's own settings where it has them, else decode's defaults (`default_of`)."""

from __future__ import annotations

from services.common.settings import default_of


def decode_role_builder(settings, transfer_tls):
    """A disagg decode role on a fresh KV side channel (a prefill worker's settings have no receiver's own)."""

    async def build(worker):
        from services.decode.settings import DecodeSettings
        from services.decode.worker import DecodeRole
        from services.common.options import side_channel_address
        from shared.transfer import KVReceiver

        def own(name):
            return getattr(settings, name, default_of(DecodeSettings, name))

        receiver = KVReceiver(tls=transfer_tls)
        host, advertise = side_channel_address(settings, own("kv_receiver_host"), own("kv_receiver_advertise"))
        await receiver.start(host, own("kv_receiver_port"), advertise_host=advertise)
        return DecodeRole(worker, mode="disagg", max_active_requests=own("max_active_requests"), receiver=receiver,
                          prefill_timeout_s=own("prefill_timeout"), drain_timeout_s=own("drain_timeout"))

    return build
