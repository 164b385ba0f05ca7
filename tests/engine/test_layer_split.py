"""The layer count the launcher checks a pipeline's split against, read from the model's config.json, and the
launcher's planning of a pipeline done without torch (its process stays small)."""

import json
import subprocess
import sys

import pytest

from shared.engine import ModelLoadError, model_layer_count
from support.processes import ROOT


def test_the_layer_count_is_the_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 7}))
    assert model_layer_count(tmp_path) == 7


@pytest.mark.parametrize("config", ["{not json", json.dumps({"model_type": "llama"}),
                                    json.dumps({"num_hidden_layers": 0}), json.dumps({"num_hidden_layers": "4"}),
                                    json.dumps([4])])
def test_a_config_without_a_layer_count_is_refused(tmp_path, config):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match="config"):
        model_layer_count(tmp_path)
    with pytest.raises(ModelLoadError):
        model_layer_count(tmp_path / "missing")


def test_planning_a_pipeline_imports_no_torch(default_model):
    script = f"""
import sys
from services.launcher.served_models import pipeline_split
from services.launcher.up_settings import UpSettings
ranges = pipeline_split(UpSettings(models=({default_model!r},), topology="pipeline", stages=2), {default_model!r})
print(ranges, "torch" in sys.modules, "transformers" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(")) ")[-1].split() == ["False", "False"], done.stdout
