"""docs/configuration.md is what `splitserve config-docs` writes from the settings classes today."""

from pathlib import Path

from services.cli.config_docs import COMMAND, render, settings_classes, settings_modules

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_configuration_page_is_the_settings_classes():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date with the settings classes: run `{COMMAND}`"


def test_the_page_covers_up_and_every_service():
    modules = settings_modules()
    assert modules[0] == "services.launcher.up_settings"
    roles = {module.split(".")[1] for module in modules[1:]}
    assert roles >= {"gateway", "scheduler", "decode", "prefill", "stage", "kvstore"}, roles
    text = PAGE.read_text()
    for module in modules:
        assert settings_classes(module), f"{module} defines no settings class to document"
        for settings in settings_classes(module):
            for name, field in settings.model_fields.items():
                assert field.description, f"{settings.__name__}.{name} has no description to document"
    assert "## `splitserve up`" in text and "## `splitserve serve gateway`" in text
