"""Model directories that cannot be served get one clear error naming the problem."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from shared.engine.errors import ModelLoadError
from shared.engine.model_loader import LayerRange, load_model

ROOT = Path(__file__).resolve().parents[2]


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(file)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="cannot read the config"):
        load_model(tmp_path)


# Root reads files whatever their mode: as root, the load runs in a child that has dropped to nobody.
_LOAD_AS_NOBODY = """
import os, sys
from shared.engine.errors import ModelLoadError
from shared.engine.model_loader import load_model
os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    load_model(sys.argv[1])
except ModelLoadError as exc:
    print(exc)
"""


def test_config_without_read_permission(default_model):
    with tempfile.TemporaryDirectory() as directory:  # under /tmp, so nobody can reach it
        os.chmod(directory, 0o755)
        config = Path(directory, "config.json")
        shutil.copy(os.path.join(default_model, "config.json"), config)
        config.chmod(0)
        if os.geteuid() == 0:
            child = subprocess.run([sys.executable, "-c", _LOAD_AS_NOBODY, directory], cwd=ROOT,
                                   capture_output=True, text=True, timeout=120)
            assert child.returncode == 0, child.stderr
            error = child.stdout
        else:
            with pytest.raises(ModelLoadError) as info:
                load_model(directory)
            error = str(info.value)
    assert "cannot read the config" in error and "Permission denied" in error, error


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*t5"):
        load_model(tmp_path)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ModelLoadError, match="cannot read the config"):
        load_model(tmp_path)


def test_missing_weights(tmp_path, default_model):
    shutil.copy(os.path.join(default_model, "config.json"), tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_truncated_weights(tmp_path, default_model):
    shutil.copy(os.path.join(default_model, "config.json"), tmp_path / "config.json")
    data = open(os.path.join(default_model, "model.safetensors"), "rb").read()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="weights"):
        load_model(tmp_path)


def test_layer_range_beyond_the_model(default_model):
    with pytest.raises(ModelLoadError, match="exceeds the model's 4 layers"):
        load_model(default_model, layer_range=LayerRange(2, 6))


def test_bad_dtype(default_model):
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model(default_model, dtype="float8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_generates(default_model, dtype):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=default_model, dtype=dtype, num_kv_blocks=32), load_tokenizer=False)
    assert engine.executor.runners[0].kv_cache.tensor.dtype == getattr(torch, dtype)
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("quantization", [{"quant_method": "fp8", "activation_scheme": "dynamic"},
                                          {"quant_method": "awq", "bits": 4, "group_size": 128}])
def test_a_quantized_checkpoint_is_refused_never_loaded_wrong(tmp_path, default_model, quantization):
    model_dir = tmp_path / "quantized"
    shutil.copytree(default_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelLoadError, match=f"is quantized \\({quantization['quant_method']}\\)"):
        load_model(str(model_dir), dtype="float32")


def test_sharded_safetensors_load_as_one_checkpoint(tmp_path, default_model):
    """A checkpoint saved in shards (with its index) serves the same tokens as the single file."""
    from transformers import AutoModelForCausalLM

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams

    sharded = tmp_path / "sharded"
    shutil.copytree(default_model, sharded, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    AutoModelForCausalLM.from_pretrained(default_model).save_pretrained(sharded, max_shard_size="1MB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = [LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32)).generate(
        [[5, 17, 300, 42]], params)[0].token_ids for path in (default_model, sharded)]
    assert outputs[0] == outputs[1]
