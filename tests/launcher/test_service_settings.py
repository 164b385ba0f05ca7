"""Each service's settings have one home (its settings class): the flags, the SPLITSERVE_* variables and the
defaults come from it; a bad value is a usage error naming its source; the deployment files set only variables
some setting reads."""

import importlib
import re
import subprocess
import sys

import pytest
from launcher_helpers import ROOT

from services.common.settings import env_of, flag_of
from services.gateway.settings import GatewayServiceSettings

SERVICES = ("gateway", "scheduler", "decode", "prefill", "stage", "kvstore")
# Read by code outside the settings: the credentials' seed (a secret, never a flag), the model cache, the run dir.
NOT_SETTINGS = {"SPLITSERVE_NATS_NKEY_SEED", "SPLITSERVE_CACHE_DIR", "SPLITSERVE_RUN_DIR"}


def settings_class(name: str):
    return type(importlib.import_module(f"services.{name}.__main__").settings_of(
        ["--layers", "0:1", "--stages", "s1"] if name == "stage" else [], environ={}))


@pytest.mark.parametrize("name", SERVICES)
def test_every_setting_has_a_flag_a_variable_and_its_default_written(name):
    module = importlib.import_module(f"services.{name}.__main__")
    settings = settings_class(name)
    flags = {action.dest: action for action in module.build_parser()._actions if action.dest != "help"}
    assert set(flags) == set(settings.model_fields)
    for field_name, action in flags.items():
        assert action.option_strings[0] == flag_of(field_name, settings.model_fields[field_name])
        assert env_of(field_name, settings.model_fields[field_name]) in action.help and "default" in action.help


@pytest.mark.parametrize("name", SERVICES)
def test_each_variable_sets_one_setting(name):
    settings = settings_class(name)
    variables = [env_of(field_name, field) for field_name, field in settings.model_fields.items()]
    assert len(variables) == len(set(variables)), sorted(v for v in variables if variables.count(v) > 1)


def test_a_flag_wins_over_a_variable_over_the_default():
    from services.decode.__main__ import settings_of

    env = {"SPLITSERVE_MAX_NUM_SEQS": "7", "SPLITSERVE_NATS_URL": "nats://a:4222", "SPLITSERVE_CPUS": "0-1"}
    settings = settings_of(["--max-num-seqs", "9", "--instance-id", "d-3"], environ=env)
    assert (settings.max_num_seqs, settings.nats, settings.cpus, settings.instance_id) == (9, "nats://a:4222", (0, 1),
                                                                                             "d-3")
    assert settings.kv_cache_bytes == type(settings).model_fields["kv_cache_bytes"].default
    unnamed = settings_of([], environ={})
    assert unnamed.instance_id.startswith("decode-")  # ROLE-HOST-PID


def test_the_gateways_keys_come_from_flags_or_the_variable_and_never_show():
    settings = GatewayServiceSettings(api_keys=(" a ", "", "a", "b"))
    assert settings.api_keys == ("a", "b") and "api_keys" not in repr(settings)
    from services.gateway.__main__ import settings_of

    assert settings_of([], environ={"SPLITSERVE_API_KEY": "k1,k2"}).api_keys == ("k1", "k2")
    both = settings_of(["--api-key", "f1"], environ={"SPLITSERVE_API_KEY": "k1,k2"})  # a flag's keys join them
    assert both.api_keys == ("f1", "k1", "k2")
    assert settings_of(["--expect", "decode=2"], environ={}).expect == {"decode": 2}


@pytest.mark.parametrize("argv, env, says", [
    (["--max-num-seqs", "0"], {}, "argument --max-num-seqs: Input should be greater than or equal to 1"),
    ([], {"SPLITSERVE_KV_CACHE_BYTES": "lots"}, "SPLITSERVE_KV_CACHE_BYTES: Input should be a valid integer"),
    (["--cpus", "3-1"], {}, "argument --cpus"),
    (["--mode", "ring"], {}, "invalid choice"),
    (["--gpu-memory-utilization", "0.9"], {}, "error: --gpu-memory-utilization shares out a GPU's memory, and this "
                                               "worker runs on cpu"),
])
def test_a_bad_setting_is_a_usage_error_naming_its_source(argv, env, says):
    result = subprocess.run([sys.executable, "-m", "services.decode", *argv], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env})
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_stage_needs_its_layers():
    result = subprocess.run([sys.executable, "-m", "services.stage"], capture_output=True, text=True, timeout=60,
                            cwd=ROOT, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and "--layers is required (or SPLITSERVE_LAYERS)" in result.stderr


def test_the_deployment_files_set_only_variables_a_setting_reads():
    read = {env_of(name, field) for service in SERVICES for name, field in settings_class(service).model_fields.items()}
    for path in [*(ROOT / "compose").glob("*.yml"), *(ROOT / "deploy").rglob("*.yaml"), ROOT / "Dockerfile"]:
        used = set(re.findall(r"SPLITSERVE_[A-Z_]+", path.read_text()))
        assert used <= read | NOT_SETTINGS, (path, sorted(used - read - NOT_SETTINGS))
