"""The gateway's edge against a real deployment: API keys, body size limits, strings that are not Unicode."""

import http.client
import json
from urllib.parse import urlsplit

import httpx
import pytest

from support.deployment import start_deployment

MODEL = "splitserve-default-llama"
ENV_KEYS = "env-key-1f3a,env-key-77c0"
FLAG_KEY = "flag-key-9b2e"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def guarded(nats_server, default_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    deployment = start_deployment(nats_server.url, log_dir, default_model,
                                  gateway_args=("--api-key", FLAG_KEY, "--protect-metrics",
                                                "--max-request-bytes", str(LIMIT)),
                                  gateway_env={"SPLITSERVE_API_KEY": ENV_KEYS})
    yield deployment
    deployment.stop()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def completion(base_url: str, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 2, **body})


def assert_error(response: httpx.Response, status: int, code: str, param=None) -> None:
    assert response.status_code == status, response.text
    assert response.headers.get("x-request-id")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)


def test_api_keys_guard_the_api_and_metrics_but_not_health(guarded):
    url = guarded.base_url
    assert_error(completion(url), 401, "invalid_api_key")
    assert_error(completion(url, bearer("env-key-1f3")), 401, "invalid_api_key")  # a prefix of a key
    assert_error(completion(url, {"Authorization": f"Basic {FLAG_KEY}"}), 401, "invalid_api_key")
    assert completion(url).headers["www-authenticate"] == "Bearer"
    for key in [*ENV_KEYS.split(","), FLAG_KEY]:
        assert completion(url, bearer(key)).status_code == 200
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=bearer(FLAG_KEY), timeout=10).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=bearer(FLAG_KEY), timeout=10).status_code == 200
    logs = "".join(p.read_text(errors="replace") for p in guarded.log_dir.glob("gateway-*.log"))
    assert not any(key in logs for key in [*ENV_KEYS.split(","), FLAG_KEY])


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_bodies_over_the_limit_are_413_whether_declared_or_streamed(guarded):
    url, headers = guarded.base_url, bearer(FLAG_KEY)
    before = _rss_kib(guarded.procs["gateway"].pid)
    huge = json.dumps({"model": MODEL, "prompt": "x" * (50 << 20)}).encode()
    response = httpx.post(f"{url}/v1/completions", headers={**headers, "content-type": "application/json"},
                          content=huge, timeout=60)
    assert_error(response, 413, "request_too_large")

    def chunks():  # no Content-Length: the gateway learns the size only by reading
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(64):
            yield b"y" * 4096
        yield b'"}'

    response = httpx.post(f"{url}/v1/completions", headers={**headers, "content-type": "application/json"},
                          content=chunks(), timeout=60)
    assert_error(response, 413, "request_too_large")
    assert _rss_kib(guarded.procs["gateway"].pid) - before < 20 << 10  # the 50 MB body was never held
    assert completion(url, headers, user="z" * (LIMIT - 200)).status_code == 200  # just under the limit: served


def test_lone_surrogates_are_400_and_the_connection_stays_usable(guarded):
    address = urlsplit(guarded.base_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    headers = {**bearer(FLAG_KEY), "content-type": "application/json"}
    cases = [  # raw JSON: the escape reaches the server as written
        ('{"model": "%s", "prompt": "a\\ud800b"}' % MODEL, "/v1/completions", "prompt"),
        ('{"model": "\\udfff", "prompt": "a"}', "/v1/completions", "model"),
        ('{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud83d"}]}' % MODEL, "/v1/chat/completions",
         "messages[0].content"),
        ('{"model": "%s", "prompt": "a", "stop": ["ok", "\\ud800"]}' % MODEL, "/v1/completions", "stop[1]"),
    ]
    try:
        for body, path, param in cases:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
            assert response.status == 400 and (error["param"], error["code"]) == (param, "invalid_value"), error
        # The same connection (http.client never reconnects on its own) still serves a good request.
        connection.request("POST", "/v1/completions", headers=headers,
                           body=json.dumps({"model": MODEL, "prompt": "fine \U0001F600", "max_tokens": 2}))  # a pair: fine
        response = connection.getresponse()
        assert response.status == 200, response.read()
        response.read()
    finally:
        connection.close()
