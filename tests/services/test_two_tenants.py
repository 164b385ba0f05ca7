"""Two tenants on a real deployment (nats-server, the services, HTTP, the openai client): counters equal the
responses' usage, a tenant past its max_in_flight gets 429 + Retry-After while the other is served, and prefixes
are shared within a tenant, never across."""

import os

import openai
import pytest

from support.deployment import start_deployment
from support.metrics import matching, samples

MODEL = "splitserve-default-llama"
KEYS_FILE = """
tenants:
  alpha: {max_in_flight: 1}
keys:
  - {key: sk-alpha-1, tenant: alpha}
  - {key: sk-alpha-2, tenant: alpha}
"""


@pytest.fixture(scope="module")
def tenants(nats_server, default_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    keys = log_dir / "keys.yaml"
    keys.write_text(KEYS_FILE)
    os.chmod(keys, 0o600)
    deployment = start_deployment(nats_server.url, log_dir, default_model,
                                  gateway_args=("--api-keys-file", str(keys), "--max-dispatched", "2"),
                                  gateway_env={"SPLITSERVE_API_KEY": "sk-beta:beta"})
    yield deployment
    deployment.stop()


def client(deployment, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.api, api_key=key, max_retries=0, timeout=60)


def tenant_tokens(deployment) -> dict[tuple[str, str], float]:
    found = samples(deployment.base_url)
    return {(tenant, kind): sum(matching(found, "splitserve_tenant_tokens_total", tenant=tenant, kind=kind))
            for tenant in ("alpha", "beta") for kind in ("prompt", "completion")}


def test_tenant_counters_equal_the_sum_of_the_responses_usage(tenants):
    before = tenant_tokens(tenants)
    reported = {key: 0 for key in before}
    for key, tenant in (("sk-alpha-1", "alpha"), ("sk-beta", "beta")):
        api = client(tenants, key)
        usages = [api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7).usage,
                  api.completions.create(model=MODEL, prompt="The river", max_tokens=5, n=2, temperature=1).usage]
        stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                             max_tokens=6, stream=True, stream_options={"include_usage": True})
        usages += [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usages) == 3
        for usage in usages:
            reported[tenant, "prompt"] += usage.prompt_tokens
            reported[tenant, "completion"] += usage.completion_tokens
    after = tenant_tokens(tenants)
    assert {k: after[k] - before[k] for k in after} == reported
    found = samples(tenants.base_url)
    assert sum(matching(found, "splitserve_tenant_requests_total", tenant="beta", status="ok")) >= 3
    assert not [s for s in found.get("splitserve_tenant_tokens_total", []) if "sk-" in s.labels["tenant"]]


def test_a_tenant_past_max_in_flight_gets_429_with_retry_after_while_the_other_is_served(tenants):
    held = client(tenants, "sk-alpha-1").completions.create(
        model=MODEL, prompt="Count:", max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(held))  # in flight, and stays so: nobody reads it
        with pytest.raises(openai.RateLimitError) as raised:
            client(tenants, "sk-alpha-2").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        response = raised.value.response
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "max_in_flight" in error["message"]
        served = client(tenants, "sk-beta").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert served.usage.completion_tokens == 2
    finally:
        held.close()
    found = samples(tenants.base_url)
    assert sum(matching(found, "splitserve_tenant_rejected_total", tenant="alpha", reason="max_in_flight")) == 1


def test_keys_of_one_tenant_share_prefixes_and_tenants_never_do(tenants):
    prompt = "A long and unusual prompt about lighthouses, logbooks and the sea, " * 3

    def cached(key: str) -> int:
        usage = client(tenants, key).completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
        return usage.prompt_tokens_details.cached_tokens

    first, same_tenant, other_tenant = cached("sk-alpha-1"), cached("sk-alpha-2"), cached("sk-beta")
    assert first == 0 and same_tenant > 0 and other_tenant == 0
