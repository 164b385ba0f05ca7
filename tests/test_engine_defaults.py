"""Settings with one source of defaults."""


def test_the_engine_defaults_have_one_home():
    """The services' engine settings default to what EngineConfig and the step scheduler do (shared.engine.defaults)."""
    import dataclasses

    from services.common.service_settings import EngineSettings
    from shared.engine.config import EngineConfig
    from shared.engine.scheduler import SchedulerConfig

    flags = EngineSettings()
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    scheduler = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
        assert getattr(flags, name) == engine[name], name
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        assert scheduler[name] == engine[name], name
