"""compose/docker-compose.pipeline.yml: every command a real invocation, the stages one consistent pipeline."""

import pytest
import yaml
from launcher_helpers import ROOT

from services.cli import main as cli_main
from services.stage.__main__ import settings_of as stage_settings
from shared.engine.default_model import DEFAULT_MODEL_NAME
from shared.engine.model_loader import LayerRange
from shared.engine.pipeline import check_layer_split

COMPOSE = ROOT / "compose" / "docker-compose.pipeline.yml"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_the_stages_form_one_pipeline_over_the_default_model(services, default_model):
    from shared.engine.model_loader import read_config

    stages = {name: stage_settings(svc["command"][2:], environ={}) for name, svc in services.items()
              if svc["command"][:2] == ["serve", "stage"]}
    heads = [args for args in stages.values() if args.layers.start == 0]
    assert len(heads) == 1
    head = heads[0]
    assert set(head.stages) | {head.instance_id} == set(stages)  # every stage container is in the pipeline
    ranges = [head.layers] + [stages[name].layers for name in head.stages]
    check_layer_split([LayerRange(r.start, r.end) for r in ranges], read_config(default_model).num_hidden_layers)
    for name, args in stages.items():
        assert args.instance_id == name and args.transfer_host == "0.0.0.0" and args.transfer_advertise == name
        assert args.model == args.served_model_name == DEFAULT_MODEL_NAME and args.activation_transport == "tcp"
        assert "nats" in services[name]["depends_on"]


def test_the_gateway_expects_what_runs(services):
    command = services["gateway"]["command"]
    expect = dict(item.split("=") for item in command[command.index("--expect") + 1].split(","))
    stage_count = sum(1 for svc in services.values() if svc["command"][:2] == ["serve", "stage"])
    assert {role: int(n) for role, n in expect.items()} == {"decode": 1, "scheduler": 1, "stage": stage_count - 1}


def test_every_command_parses_with_the_cli(services):
    for name, svc in services.items():
        if name == "nats":
            assert "--jetstream" in svc["command"]
            continue
        args = cli_main.build_parser().parse_args(svc["command"])
        if name == "provision":  # the one-shot provisioner, with the admin key
            assert args.command == "provision" and svc["env_file"] == ["secrets/admin.env"]
            continue
        assert args.name == svc["command"][1]
