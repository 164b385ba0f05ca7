"""API keys to tenants: `--api-key KEY[:TENANT]` entries and the keys file."""

import os

import pytest

from services.common.api_keys import key_id, split_key_entry
from services.gateway.settings import GatewayServiceSettings
from services.common.tenant_keys import DEFAULT_TENANT, Tenant, parse_keys_file, read_keys_file, tenant_keys
from services.gateway.tenants import TenantDirectory

FILE = """
tenants:
  acme: {max_in_flight: 2, tokens_per_minute: 600, priority: 1}
keys:
  - {key: sk-acme-1, tenant: acme}
  - {key: sk-acme-2, tenant: acme}
  - {key: sk-solo}
"""


@pytest.mark.parametrize("entry, parsed", [
    ("sk-1", ("sk-1", None)),
    ("sk-1:acme", ("sk-1", "acme")),
    ("a:b:team.x", ("a:b", "team.x")),  # split at the last colon
])
def test_key_entries(entry, parsed):
    assert split_key_entry(entry) == parsed


@pytest.mark.parametrize("entry", [":acme", "sk-1:", "sk-1:bad name", "sk-1:" + "x" * 65])
def test_malformed_key_entries_are_refused_without_naming_the_key(entry):
    with pytest.raises(ValueError) as raised:
        split_key_entry(entry)
    assert "sk-1" not in str(raised.value)


def test_a_bare_key_is_its_own_tenant_named_by_a_short_id_that_is_not_the_key():
    keys = tenant_keys(["sk-secret-1", "sk-a:team", "sk-b:team"])
    assert keys["sk-a"] == keys["sk-b"] == Tenant("team")
    assert keys["sk-secret-1"].name == key_id("sk-secret-1") != key_id("sk-secret-2")
    assert "secret" not in keys["sk-secret-1"].name and key_id("sk-secret-1").startswith("key-")


def test_the_keys_file_gives_tenants_limits_and_flags_may_name_its_tenants():
    parsed = parse_keys_file(FILE)
    keys = tenant_keys(["sk-flag:acme"], parsed)
    acme = Tenant("acme", max_in_flight=2, tokens_per_minute=600, priority=1)
    assert keys["sk-acme-1"] == keys["sk-acme-2"] == keys["sk-flag"] == acme
    assert keys["sk-solo"] == Tenant(key_id("sk-solo"))
    assert parse_keys_file('{"keys": [{"key": "k", "tenant": "t"}]}', json_format=True).keys == [("k", "t")]


@pytest.mark.parametrize("text, says", [
    ("keys: [{tenant: acme}]", "keys.0.key: Field required"),
    ("keys: [{key: sk-hidden, tenant: 'a b'}]", "keys.0.tenant"),
    ("keys: [{key: sk-hidden, limit: 3}]", "keys.0.limit: Extra inputs"),
    ("tenants: {acme: {max_in_flight: -1}}", "tenants.acme.max_in_flight"),
    ("tenants: {acme: {tokens_per_minute: many}}", "tenants.acme.tokens_per_minute"),
    ("tenants: {'a b': {}}", "tenants.a b"),
    ("keys: [oops", "not valid YAML"),
    ("- just a list", "the file"),
])
def test_malformed_files_say_where_and_never_the_key(text, says):
    with pytest.raises(ValueError) as raised:
        parse_keys_file(text)
    assert says in str(raised.value) and "sk-hidden" not in str(raised.value)


def test_a_key_given_two_tenants_is_refused():
    with pytest.raises(ValueError, match="two tenants"):
        tenant_keys(["sk-1:a", "sk-1:b"])


def test_a_keys_file_open_to_others_is_refused_at_startup(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_keys_file(str(path))
    with pytest.raises(ValueError, match="chmod 600"):
        GatewayServiceSettings(keys_file=str(path))
    os.chmod(path, 0o600)
    assert GatewayServiceSettings(keys_file=str(path)).keys_file == str(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_keys_file(str(tmp_path / "missing.yaml"))


def test_the_directory_finds_a_tenant_by_its_bearer_key():
    directory = TenantDirectory(tenant_keys(["sk-a:team", "sk-b"]))
    assert directory.tenant_for("Bearer sk-a") == Tenant("team")
    assert directory.tenant_for("Bearer sk-b") == Tenant(key_id("sk-b"))
    assert directory.tenant_for("Bearer sk-") is None and directory.tenant_for(None) is None
    assert directory.tenant_for("Basic sk-a") is None
    assert TenantDirectory({}).tenant_for(None) == DEFAULT_TENANT and not TenantDirectory({}).guarded


def test_the_directory_counts_its_tenants():
    """Fair admission has something to do only with two tenants or more (the gateway turns it off with one)."""
    assert TenantDirectory.of([], None).tenants == 1
    assert TenantDirectory.of(["k1:acme", "k2:acme"], None).tenants == 1
    assert TenantDirectory.of(["k1:acme", "k2:beta"], None).tenants == 2
    assert TenantDirectory.of(["k1", "k2"], None).tenants == 2  # a bare key is its own tenant
