"""The prefill role as a switchable worker takes it on its loaded engine (`services.common.role_switch`): from the
worker's own settings where it has them, else prefill's defaults (`default_of`)."""

from __future__ import annotations

from services.common.settings import default_of


def prefill_role_builder(settings, transfer_tls):
    async def build(worker):
        from services.prefill.settings import PrefillSettings
        from services.prefill.worker import PrefillRole

        def own(name):
            return getattr(settings, name, default_of(PrefillSettings, name))

        return PrefillRole(worker, max_concurrent_jobs=own("max_concurrent_jobs"), kv_transport=own("kv_transport"),
                           transfer_tls=transfer_tls)

    return build
