"""What the services make of their settings (`services.common.service_settings`): NATS credentials and TLS, the
side channel's TLS and address, the model, the engine's config and CPUs."""

from services.common.service_settings import (
    BusSettings,
    EngineSettings,
    ModelSettings,
    SideChannelSettings,
)


def bus_credentials(settings: BusSettings):
    """The service's NATS credentials (see `shared.bus.credentials`), checked now: exits if they are unusable."""
    from shared.bus.credentials import CredentialsError, credentials_from

    credentials = credentials_from(settings.nats_creds)
    try:
        credentials.connect_options()
    except CredentialsError as exc:
        raise SystemExit(f"error: {exc}") from None
    return credentials


def bus_tls(settings: BusSettings):
    """The NATS connection's TLS context (see `shared.bus.tls`), or None; exits if the files are unusable."""
    from shared.bus.tls import TLSConfigError, client_tls_context

    try:
        return client_tls_context(settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key)
    except TLSConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


def transfer_tls_of(settings: SideChannelSettings):
    """The side channel's TLS (see `shared.transfer.tls`), or None; exits if the files are unusable."""
    from shared.transfer.tls import TransferTLSError, transfer_tls

    try:
        return transfer_tls(settings.transfer_tls_ca, settings.transfer_tls_cert, settings.transfer_tls_key)
    except TransferTLSError as exc:
        raise SystemExit(f"error: {exc}") from None


def resolve_model(settings: ModelSettings) -> tuple[str, str]:
    """(model directory, served model name) of --model (see `shared.engine.model_registry`); exits if it names none."""
    resolved = _resolved(settings.model)
    return str(resolved.model_dir), settings.served_model_name or resolved.served_model_name


def resolve_model_dir(model: str) -> str:
    """The directory of a model given as --model takes it; exits if it names none."""
    return str(_resolved(model).model_dir)


def _resolved(model: str | None):
    from shared.engine import ModelLoadError, resolve_model as resolve

    try:
        return resolve(model)
    except ModelLoadError as exc:
        raise SystemExit(f"error: {exc}") from None


def run_async(coro) -> int:
    """Run a service's main coroutine on uvloop (the design's event loop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def apply_engine_placement(settings: EngineSettings) -> None:
    """Bind the worker to its --cpus (see `services.common.cpus`); call first thing in a worker's main. A
    borrower's lent CPUs are added to its engine thread's team later (`services.common.cpu_loan`)."""
    from services.common.cpus import bind_cpus

    borrowed = getattr(settings, "borrow_cpus", None)
    if borrowed is not None or (getattr(settings, "cpu_loan", None) and hasattr(settings, "borrow_cpus")):
        from services.common.cpu_loan import check_borrowing

        try:
            check_borrowing(settings.cpus, borrowed, settings.cpu_loan)
        except ValueError as exc:
            raise SystemExit(f"splitserve: {exc}") from None
    elif getattr(settings, "cpu_loan", None) and not settings.cpus:
        raise SystemExit("splitserve: --cpu-loan lends this worker's --cpus: give them")
    if settings.cpus:
        bind_cpus(settings.cpus)


def engine_config(settings: EngineSettings, model_dir: str):
    from shared.engine import EngineConfig

    return EngineConfig(
        model=model_dir,
        dtype=settings.dtype,
        device=settings.device,
        block_size=settings.block_size,
        kv_cache_bytes=settings.kv_cache_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        scheduling_policy=settings.scheduling_policy,
        max_model_len=settings.max_model_len,
        prefill_beside_decodes_ms=settings.prefill_beside_decodes_ms,
    )


def side_channel_address(settings: SideChannelSettings, listen: str | None, advertise: str | None) -> tuple[str, str | None]:
    """(listen on, advertise) for one of the service's receivers (see `services.common.advertise`); `settings`
    also has the bus's (`nats`: where the address that routes to NATS is looked up)."""
    from services.common.advertise import route_address, side_channel_addresses

    return side_channel_addresses(listen, advertise, settings.advertise_host, lambda: route_address(settings.nats))
