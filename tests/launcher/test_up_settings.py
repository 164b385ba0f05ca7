"""`up`'s settings have one home (`UpSettings`): flags, SPLITSERVE_* variables and a YAML config file all come
from it, a flag winning over a variable over the file over the default, and a bad value names where it came from."""

import argparse

import pytest

from services.cli.main import build_parser
from services.common.settings import Settings, SettingsError, add_flags, option, settings_from
from services.launcher.up_settings import UpSettings

from launcher_helpers import cli


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_a_flag_wins_over_a_variable_over_the_file_over_the_default(tmp_path):
    config = tmp_path / "up.yaml"
    config.write_text("decode: 3\nprefill: 2\nmax-num-batched-tokens: 512\nkv_store_ram_bytes: 4096\n")
    env = {"SPLITSERVE_PREFILL": "4", "SPLITSERVE_MAX_NUM_BATCHED_TOKENS": "256"}
    settings = settings_from(UpSettings, up_args("--max-num-batched-tokens", "128"), config, env)
    assert (settings.decode, settings.prefill, settings.max_num_batched_tokens) == (3, 4, 128)
    assert settings.kv_store_ram_bytes == 4096 and settings.topology == "disagg"  # the file, then the default
    assert settings_from(UpSettings, up_args(), None, {}) == UpSettings()


def test_switches_lists_and_renamed_settings():
    settings = settings_from(UpSettings, up_args("--no-kv-store", "--api-key", "a", "--api-key", "b",
                                                 "--ready-timeout", "7", "--tls"), None, {})
    assert settings.kv_store is False and settings.api_keys == ("a", "b") and settings.ready_timeout_s == 7.0
    assert settings.tls is True and "api_keys" not in repr(settings)  # a key never shows
    from_env = settings_from(UpSettings, up_args(), None, {"SPLITSERVE_API_KEY": "k1, k2", "SPLITSERVE_TLS": "true",
                                                           "SPLITSERVE_NATS_URL": "nats://n:4222",
                                                           "SPLITSERVE_READY_TIMEOUT": "9"})
    assert from_env.api_keys == ("k1", "k2") and from_env.tls and from_env.nats == "nats://n:4222"
    assert from_env.ready_timeout_s == 9.0


@pytest.mark.parametrize("argv, env, file, named", [
    (("--decode", "0"), {}, None, "argument --decode"),
    ((), {"SPLITSERVE_PORT": "http"}, None, "SPLITSERVE_PORT"),
    ((), {}, "topology: ring\n", "topology"),
    ((), {}, "decodes: 2\n", "unknown setting(s) decodes"),
    ((), {}, "- decode\n", "expected a mapping"),
])
def test_a_bad_setting_is_named_by_where_it_came_from(tmp_path, argv, env, file, named):
    config = None
    if file is not None:
        config = tmp_path / "up.yaml"
        config.write_text(file)
    with pytest.raises(SettingsError, match=named.replace("(", r"\(").replace(")", r"\)")):
        settings_from(UpSettings, up_args(*argv), config, env)


def test_a_secrets_bad_value_is_never_echoed():
    class Secret(Settings):
        token: str = option("", "a secret", min_length=8, repr=False)

    parser = argparse.ArgumentParser()
    add_flags(parser, Secret)
    with pytest.raises(SettingsError) as raised:
        settings_from(Secret, parser.parse_args(["--token", "short"]), None, {})
    assert "argument --token" in str(raised.value) and "short" not in str(raised.value)


def test_every_setting_has_a_flag_a_variable_and_a_description():
    parser = argparse.ArgumentParser()
    add_flags(parser, UpSettings)
    helps = {action.dest: action.help for action in parser._actions if action.dest != "help"}
    assert set(helps) == set(UpSettings.model_fields)
    for name, text in helps.items():
        assert "SPLITSERVE_" in text and "default" in text and len(text) > 40, name


def test_up_reads_its_config_file_and_refuses_a_bad_one(tmp_path):
    config = tmp_path / "up.yaml"
    config.write_text("topology: colocated\nstages: 2\n")  # the launcher's own checks see the file's values
    result = cli("up", "--run-dir", str(tmp_path / "run"), "--config", str(config))
    assert result.returncode == 2 and "needs --topology pipeline" in result.stderr, result.stderr
    config.write_text("decode: many\n")
    result = cli("up", "--run-dir", str(tmp_path / "run"), env={"SPLITSERVE_CONFIG": str(config)})
    assert result.returncode == 2 and f"{config}: decode" in result.stderr and "Traceback" not in result.stderr


def test_the_variables_up_read_do_not_reach_its_services():
    """`SPLITSERVE_DEVICE=cuda splitserve up --device cpu`: the workers run on the CPU. What up read is in each
    service's flags; a service reading the same variable where up passed no flag would undo up's decision."""
    import importlib

    from services.cli.up import forget_up_variables
    from services.launcher import topology
    from services.launcher.resolved_run import ResolvedRun

    environ = {"SPLITSERVE_DEVICE": "cuda", "SPLITSERVE_CPUS": "none", "SPLITSERVE_PREFILL_BESIDE_DECODES_MS": "0",
               "SPLITSERVE_KV_STORE": "true", "SPLITSERVE_CONFIG": "/etc/up.yaml", "SPLITSERVE_API_KEY": "secret",
               "SPLITSERVE_CACHE_DIR": "/cache", "SPLITSERVE_NATS_CREDS": "/creds/decode.nk", "PATH": "/bin"}
    settings = settings_from(UpSettings, up_args("--device", "cpu", "--prefill-beside-decodes-ms", "0",
                                                 "--no-kv-store"), None, environ)
    assert settings.device == "cpu" and not settings.kv_store
    forget_up_variables(environ)
    assert environ == {"SPLITSERVE_CACHE_DIR": "/cache", "SPLITSERVE_NATS_CREDS": "/creds/decode.nk", "PATH": "/bin"}
    specs = topology.plan(settings, ResolvedRun(model_dir="/m", served_model_name="m", nats_url="nats://127.0.0.1:1",
                                                 cpus=(), drain_timeout=None))
    for spec in specs:
        service = importlib.import_module(f"{spec.module}.__main__").settings_of(list(spec.args), environ=environ)
        if spec.role in ("decode", "prefill"):
            assert service.device == "cpu" and not service.kv_store, spec.name
