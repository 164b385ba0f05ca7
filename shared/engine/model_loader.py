"""Load a local Hugging Face causal-LM directory, or one layer range of it.

The model is built by transformers on the meta device (no memory), pruned to
the requested decoder-layer range, materialised, and filled tensor by tensor
from the safetensors files, so a range's process only ever reads and holds
its own weights. transformers' modules hold the weights; the runner moves the decoder
layers' weights into a `DecoderStack` and computes with it (paged attention
included).
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from shared.engine.defaults import DEFAULT_DEVICE, DEFAULT_DTYPE
from shared.engine.errors import ModelLoadError
from shared.engine.kv_cache import DTYPES
from shared.engine.layer_split import LayerRange

# Families whose transformers forward is exactly embed -> decoder layers -> norm -> head,
# which the runner re-creates layer range by layer range. Others (e.g. Granite's
# embedding and logit multipliers) would load but compute something else.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

_FINGERPRINT_SAMPLES = 16
_FINGERPRINT_SAMPLE_BYTES = 1 << 16


@dataclass(slots=True)
class LoadedModel:
    config: PretrainedConfig
    model: torch.nn.Module  # the transformers *ForCausalLM, pruned to `layer_range`
    layer_range: LayerRange
    num_total_layers: int
    dtype: torch.dtype
    device: torch.device
    fingerprint: bytes  # identifies the weights and KV dtype; part of every block hash
    parameter_bytes: int  # of the range's weights, as loaded

    @property
    def is_first(self) -> bool:
        return self.layer_range.start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_range.end == self.num_total_layers

    @property
    def decoder(self) -> torch.nn.Module:
        return self.model.get_decoder()

    @property
    def layers(self) -> list[torch.nn.Module]:
        return list(self.decoder.layers[self.layer_range.start : self.layer_range.end])

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads


def read_config(model_dir: str | os.PathLike) -> PretrainedConfig:
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the config of model directory {path}: {exc}") from exc
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING and config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture in {path}: model_type {config.model_type!r} is a causal LM, but splitserve "
            f"has only been verified token-exact for {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"unsupported architecture in {path}: model_type {config.model_type!r} "
            f"({', '.join(config.architectures or [])}) is not a causal language model known to transformers"
        )
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", "unknown")
        # Its weights would load by shape with their scales ignored: wrong numbers, not an error. Refused instead.
        raise ModelLoadError(f"model directory {path} is quantized ({method}); splitserve runs unquantized "
                             f"float weights only (a .gguf file is dequantized on conversion)")
    return config


def resolve_dtype(dtype: str, config: PretrainedConfig) -> torch.dtype:
    if dtype == "auto":
        configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(configured, str):
            configured = DTYPES.get(configured)
        return configured if configured in DTYPES.values() else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}: choose auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def load_model(
    model_dir: str | os.PathLike,
    dtype: str = DEFAULT_DTYPE,
    device: str = DEFAULT_DEVICE,
    layer_range: LayerRange | None = None,
) -> LoadedModel:
    path = Path(model_dir)
    config = read_config(path)
    torch_dtype = resolve_dtype(dtype, config)
    device_obj = torch.device(device)
    if device_obj.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda was requested but no CUDA device is available")
    num_layers = config.num_hidden_layers
    layer_range = layer_range or LayerRange(0, num_layers)
    if layer_range.end > num_layers:
        raise ModelLoadError(f"layer range [{layer_range.start}, {layer_range.end}) exceeds the model's {num_layers} layers")

    with torch.device("meta"):
        # The modules' own attention never runs (the runner's DecoderStack computes), so any implementation does.
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    _check_structure(model, path)
    tied = _prune_to_range(model, layer_range, num_layers)
    shared_params = _shared_parameter_names(model)
    model.to_empty(device=device_obj)
    _retie(model, shared_params)
    _load_weights(model, path, tied)
    _rebuild_rotary(model, device_obj)
    model.eval().requires_grad_(False)
    return LoadedModel(
        config=model.config,
        model=model,
        layer_range=layer_range,
        num_total_layers=num_layers,
        dtype=torch_dtype,
        device=device_obj,
        fingerprint=model_fingerprint(path, torch_dtype),
        parameter_bytes=_parameter_bytes(model),
    )


def _parameter_bytes(model: torch.nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def _check_structure(model: torch.nn.Module, path: Path) -> None:
    decoder = model.get_decoder()
    missing = [name for name in ("layers", "rotary_emb", "norm", "embed_tokens") if not hasattr(decoder, name)]
    if missing or not getattr(model, "_supports_attention_backend", False):
        raise ModelLoadError(
            f"unsupported architecture {type(model).__name__} in {path}: splitserve needs a decoder with "
            f"embed_tokens/layers/norm/rotary_emb whose attention uses transformers' attention registry"
            + (f" (missing: {', '.join(missing)})" if missing else "")
        )


def _prune_to_range(model: torch.nn.Module, layer_range: LayerRange, num_layers: int) -> dict[str, str]:
    """Drop every module outside the range; return {param name: checkpoint name} for untied copies."""
    decoder = model.get_decoder()
    is_first, is_last = layer_range.start == 0, layer_range.end == num_layers
    for index in range(num_layers):
        if not layer_range.start <= index < layer_range.end:
            decoder.layers[index] = torch.nn.Module()  # placeholder keeps checkpoint names aligned
    lm_head = model.get_output_embeddings()
    embed = decoder.embed_tokens
    tied: dict[str, str] = {}
    if not is_first and is_last and lm_head.weight is embed.weight:
        # The embedding is dropped, so the tied head gets its own parameter,
        # filled from the embedding's checkpoint tensor.
        lm_head.weight = torch.nn.Parameter(torch.empty_like(embed.weight))
        embed_name = next(n for n, p in model.named_parameters() if p is embed.weight)
        head_name = next(n for n, p in model.named_parameters() if p is lm_head.weight)
        tied[head_name] = embed_name
    if not is_first:
        decoder.embed_tokens = None
    if not is_last:
        decoder.norm = None
        model.lm_head = None
    return tied


def _shared_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names that are one tied parameter (e.g. lm_head.weight and embed_tokens.weight)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Materialising from meta gives every module its own tensor; share the tied ones again."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner_name), attr, param)


def _checkpoint_index(path: Path) -> dict[str, Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {path} has no *.safetensors weights")
    index: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    index[name] = file
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read weights file {file}: {exc}") from exc
    return index


def _load_weights(model: torch.nn.Module, path: Path, tied: dict[str, str]) -> None:
    index = _checkpoint_index(path)
    wanted = {name: tensor for name, tensor in model.state_dict().items()}
    missing = []
    by_file: dict[Path, list[tuple[str, str]]] = {}
    loaded_storage = {wanted[n].data_ptr() for n in wanted if n in index}
    for name in wanted:
        source = name if name in index else tied.get(name)
        if source is None or source not in index:
            if "rotary_emb" in name:
                continue  # recomputed from the config
            if wanted[name].data_ptr() in loaded_storage:
                continue  # tied to a tensor that is loaded (e.g. lm_head and embed_tokens)
            missing.append(name)
            continue
        by_file.setdefault(index[source], []).append((name, source))
    if missing:
        raise ModelLoadError(f"weights missing from {path}: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name, source in names:
                target = wanted[name]
                tensor = handle.get_tensor(source)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelLoadError(
                        f"weight {source} in {file} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(tensor)


def _rebuild_rotary(model: torch.nn.Module, device: torch.device) -> None:
    decoder = model.get_decoder()
    # Its inverse frequencies are computed, not stored, so they were left empty.
    with torch.device("cpu"):
        decoder.rotary_emb = type(decoder.rotary_emb)(config=model.config)
    decoder.rotary_emb.to(device)


def model_fingerprint(path: Path, dtype: torch.dtype) -> bytes:
    """Identify the weights cheaply: config, safetensors headers and sampled bytes, plus the KV dtype."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((path / "config.json").read_bytes())
    digest.update(str(dtype).encode())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as handle:
            for i in range(_FINGERPRINT_SAMPLES):
                handle.seek(size * i // _FINGERPRINT_SAMPLES)
                digest.update(handle.read(_FINGERPRINT_SAMPLE_BYTES))
    return digest.digest()
