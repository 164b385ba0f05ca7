"""The model runner every splitserve worker embeds (no NATS in here), and its public surface.

Services import the engine only from here (`from shared.engine import LLMEngine`); the submodules are the
engine's own. A name is loaded on first use, with just the submodule that defines it (module `__getattr__`):
the gateway takes `SamplingParams`, the errors and `read_config` without pulling in torch, as it did before.

    running      LLMEngine, EngineConfig, RequestOutput, SamplingParams, the errors
    KV in/out    KVConnector, LoadEnd, Continuation (going on from work done elsewhere), KVLayout, BlockSlice
    prefix cache KVEventLog, PrefixCacheEvents, the block hashes
    pipelines    PipelineHeadEngine, StageRunner, StepBatch, the layer splits (light: no torch)
    models       resolve_model and the registry, read_config, the model cache
"""

import importlib

_SURFACE = {
    # running
    "engine": ("LLMEngine", "RequestOutput"),
    "config": ("EngineConfig",),
    "defaults": ("DEFAULT_DTYPE", "DEFAULT_DEVICE", "DEFAULT_BLOCK_SIZE", "DEFAULT_KV_CACHE_BYTES",
                 "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_SEQS", "DEFAULT_MICROBATCHES",
                 "DEFAULT_STEP_TIMEOUT_S", "DEFAULT_SCHEDULING_POLICY", "SCHEDULING_POLICIES"),
    "sampling_params": ("SamplingParams", "LOGIT_BIAS_RANGE", "MAX_LOGIT_BIAS", "MAX_PRIORITY", "MAX_TOP_LOGPROBS"),
    "errors": ("EngineError", "InvalidRequestError", "ModelLoadError", "ModelFetchError"),
    "structured_output": ("MAX_COMPILE_S", "check_structured"),
    # KV in and out
    "kv_connector": ("KVConnector", "LoadEnd", "BlockExport"),
    "continuation": ("Continuation", "KVOrigin", "FirstToken"),
    "kv_cache": ("KVLayout", "PagedKVCache"),
    "block_slice": ("BlockSlice",),
    # the prefix cache
    "kv_event_log": ("KVEventLog", "PrefixCacheEvents"),
    "block_hash": ("BLOCK_HASH_BYTES", "cacheable_block_hashes"),
    # pipelines
    "pipeline": ("PipelineHeadEngine", "ShipKV", "StepResult"),
    "layer_split": ("LayerRange", "LayerSplitError", "even_split", "parse_layer_split", "check_layer_split",
                    "model_layer_count"),
    "stage": ("StageRunner",),
    "step_batch": ("StepBatch",),
    # models
    "model_loader": ("read_config", "resolve_dtype"),
    "model_registry": ("resolve_model", "cached_dir", "model_names", "DEFAULT_MODEL", "KNOWN_MODELS",
                       "RANDOM_MODEL"),
    "default_model": ("cache_root",),
}
_HOME = {name: module for module, names in _SURFACE.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
