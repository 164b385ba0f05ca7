"""A model's spec, as `up --model`, its variable, `up --config`'s `models:` and `splitserve models serve` give it:
one representation (`ModelSpec`), clear errors naming the bad key."""

import argparse

import pytest
from launcher_helpers import cli

from services.common.settings import SettingsError, add_flags, settings_from
from services.launcher.model_spec import ModelSpec, ModelSpecError, check_served_names, parse_keys, parse_model_spec
from services.launcher.served_models import further_model, further_settings, model_prefix
from services.launcher.up_settings import UpSettings


def up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, UpSettings)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("text, spec", [
    ("B", ModelSpec(model="B")),
    ("B:decode=2,prefill=1", ModelSpec(model="B", decode=2, prefill=1)),
    ("/models/b:name=b,topology=colocated,dtype=float32", ModelSpec(model="/models/b", name="b",
                                                                   topology="colocated", dtype="float32")),
    ("B:kv-store=false,stages=3", ModelSpec(model="B", kv_store=False, stages=3)),
    ("B:cpus=0,1,decode=2", ModelSpec(model="B", cpus="0,1", decode=2)),  # a CPU list's comma stays in it
    ("B:name=llama:7b", ModelSpec(model="B", name="llama:7b")),  # split at the first ':' only
])
def test_a_model_spec_reads_its_keys(text, spec):
    assert parse_model_spec(text) == spec


@pytest.mark.parametrize("text, said", [
    ("B:workers=2", "--model B:workers=2: unknown key 'workers' (known: name, dtype, topology, decode, prefill, "
                    "stages, kv_store, kv_stores, cpus)"),
    ("B:decode=0", "--model B:decode=0: decode: Input should be greater than or equal to 1"),
    ("B:topology=ring", "topology: Input should be 'colocated', 'disagg' or 'pipeline'"),
    ("B:dtype=int4", "dtype: Input should be"),
    ("B:kv_store=maybe", "kv_store: Input should be a valid boolean"),
    ("B:decode", "'decode' is not KEY=VALUE"),
    ("B:decode=1,decode=2", "decode is given twice"),
    (":decode=1", "no model before ':'"),
    ("B:name=", "name: String should have at least 1 character"),
])
def test_a_bad_spec_names_what_is_wrong(text, said):
    with pytest.raises(ModelSpecError, match=said.replace("(", r"\(").replace(")", r"\)")):
        parse_model_spec(text)


def test_the_flags_the_variable_and_the_config_file_give_the_same_specs(tmp_path):
    wanted = (ModelSpec(model="A"), ModelSpec(model="B", name="b", decode=2, prefill=1))
    flags = settings_from(UpSettings, up_args("--model", "A", "--model", "B:name=b,decode=2,prefill=1"), None, {})
    variable = settings_from(UpSettings, up_args(), None, {"SPLITSERVE_MODEL": "A;B:name=b,decode=2,prefill=1"})
    config = tmp_path / "up.yaml"
    config.write_text("models:\n  - model: A\n  - {model: B, name: b, decode: 2, prefill: 1}\n")
    from_file = settings_from(UpSettings, up_args(), config, {})
    assert flags.models == variable.models == from_file.models == wanted
    assert flags.first_model == "A" and flags.further_models == wanted[1:]
    config.write_text("model: A\n")  # one model, as before
    assert settings_from(UpSettings, up_args(), config, {}).models == (ModelSpec(model="A"),)
    assert UpSettings().first_model is None  # the default model


@pytest.mark.parametrize("argv, file, said", [
    (("--model", "A:decode=2"), None, "argument --model: the first model (A) takes up's own settings (--decode, "
                                      "--served-model-name, ...), not keys: give decode there"),
    (("--model", "A", "--model", "B:colour=red"), None, "argument --model: --model B:colour=red: unknown key 'colour'"),
    ((), "models:\n  - model: A\n  - {model: B, decodes: 2}\n", "models: model B: unknown key 'decodes'"),
    ((), "models:\n  - model: A\n  - [B]\n", "a model is MODEL[:KEY=VALUE,...] or {model: MODEL, KEY: VALUE}"),
])
def test_a_bad_model_is_a_settings_error_naming_where_it_came_from(tmp_path, argv, file, said):
    config = None
    if file is not None:
        config = tmp_path / "up.yaml"
        config.write_text(file)
    with pytest.raises(SettingsError) as raised:
        settings_from(UpSettings, up_args(*argv), config, {})
    assert said in str(raised.value)


def test_up_refuses_a_bad_model_spec_and_two_models_of_one_name(tmp_path):
    result = cli("up", "--run-dir", str(tmp_path / "run"), "--model", "A", "--model", "B:decode=x")
    assert result.returncode == 2 and "decode: Input should be a valid integer" in result.stderr, result.stderr
    result = cli("up", "--run-dir", str(tmp_path / "run"), "--model", "A", "--model", "B:name=b", "--model",
                 "C:name=b")
    assert result.returncode == 2 and "two models are served as 'b'" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "deployment.json").exists()  # nothing started


def test_served_names_are_each_models_own():
    check_served_names(["a", "b"])
    with pytest.raises(ModelSpecError, match="two models are served as 'a'"):
        check_served_names(["a", "b", "a"])
    with pytest.raises(ModelSpecError, match="may not hold '='"):
        further_model(UpSettings(), ModelSpec(model="B"), 1, "/models/b", "b=c")


def test_keys_given_one_by_one_as_models_serve_takes_them():
    assert parse_keys(["decode=2", "cpus=0", "1", "kv-store=true"], "m") == {"decode": "2", "cpus": "0,1",
                                                                             "kv_store": "true"}
    with pytest.raises(ModelSpecError, match="'decode' is not KEY=VALUE"):
        parse_keys(["decode"], "m")


def test_a_further_model_takes_ups_settings_but_for_its_own_and_the_first_models_alone():
    up = UpSettings(namespace="dep", topology="disagg", decode=2, prefill=3, dtype="bfloat16", role_switch=True,
                    chat_template="/t.jinja", max_local_prefill=0, router="load")
    b = further_settings(up, ModelSpec(model="B", topology="colocated", decode=1), "b")
    assert (b.namespace, b.served_model_name, b.topology, b.decode, b.dtype) == ("dep-b", "b", "colocated", 1,
                                                                                "bfloat16")
    assert (b.router, b.max_local_prefill) == ("load", 0)  # up's, where the model says nothing
    assert not b.role_switch and b.chat_template is None and b.planner == "none"  # the first model's alone
    pipeline = UpSettings(namespace="dep", topology="pipeline", stages=3)
    assert further_settings(pipeline, ModelSpec(model="B"), "b").stages == 3
    assert further_settings(pipeline, ModelSpec(model="B", topology="colocated"), "b").stages is None
    assert [model_prefix(i) for i in (0, 1, 2)] == ["", "m1-", "m2-"]
    with pytest.raises(ModelSpecError, match="model 'b': --stages splits a pipeline's layers"):
        further_model(UpSettings(), ModelSpec(model="B", topology="colocated", stages=2), 1, "/models/b", "b")
