"""`splitserve up --tls`: NATS and the KV side channel speak only TLS, their certificates from a CA made for the
deployment (issue 13, item 2)."""

import asyncio
import json
import ssl

import httpx
import nats
import pytest

from services.launcher.nats_auth import creds_path
from services.launcher.nats_server import read_server_info
from services.launcher.tls_files import make_deployment_tls
from shared.bus.tls import client_tls_context
from support.metrics import matching, samples
from support.up import MODEL, start_up
from support.waiting import wait_until

pytestmark = [pytest.mark.timeout(300)]


def test_a_tls_deployment_serves_and_talks_to_nats_and_moves_kv_only_over_tls(tmp_path, default_model):
    # Every prompt prefilled remotely, its KV over TCP: what crosses hosts in a real deployment.
    run = start_up(tmp_path / "run", "--topology", "disagg", "--max-local-prefill", "0", "--kv-transport", "tcp",
                   "--tls")
    try:
        deployment = json.loads((run.run_dir / "deployment.json").read_text())
        url = deployment["nats"]["url"]
        ca = run.run_dir / "tls" / "ca.pem"
        for service in deployment["services"]:  # each trusts the deployment's CA
            argv = service["argv"]
            assert argv[argv.index("--nats-tls-ca") + 1] == str(ca), service["name"]
            if service["role"] in ("decode", "prefill", "kvstore"):  # and its side channel speaks TLS only
                assert argv[argv.index("--transfer-tls-ca") + 1] == str(ca), service["name"]
                assert argv[argv.index("--transfer-tls-cert") + 1] == str(run.run_dir / "tls" / "transfer.pem")
            else:
                assert "--transfer-tls-ca" not in argv, service["name"]
        response = httpx.post(f"{run.url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "over tls", "max_tokens": 3})
        assert response.status_code == 200, response.text
        # (the decode worker's counters reach the gateway with its heartbeat)
        decode_log_path = next((run.run_dir / "logs").glob("decode-*.log"))
        try:
            wait_until(lambda: sum(matching(samples(run.url), "splitserve_kv_transfer_bytes_total", backend="tcp")),
                       30, "no KV bytes over tcp showed on the gateway's /metrics")
        except AssertionError as exc:  # say what the decode worker did instead (a fallback, and why)
            said = [line for line in decode_log_path.read_text().splitlines() if '"warning"' in line or "prefill" in line]
            raise AssertionError(f"{exc}; the decode worker logged: {said[-10:]}") from None
        decode_log = decode_log_path.read_text()
        listening = [json.loads(line) for line in decode_log.splitlines() if '"kv receiver listening"' in line]
        assert listening and all(event["tls"] is True for event in listening), listening
        host, port = url.removeprefix("nats://").rsplit(":", 1)
        assert read_server_info(host, int(port))["tls_required"] is True
        for path in (run.run_dir / "tls").iterdir():
            assert path.stat().st_mode & 0o077 == 0, path
        assert not (run.run_dir / "tls" / "ca-key.pem").exists()  # the CA's key signed one certificate, then went

        seed = str(creds_path(run.run_dir / "creds", "gateway-0"))  # any of its keys: the admin key stays in up
        # A key per instance on disk, and none that could do more: the admin (provisioner) key is in `up` only.
        instances = {s["instance_id"] for s in json.loads((run.run_dir / "deployment.json").read_text())["services"]}
        assert {p.name for p in (run.run_dir / "creds").iterdir()} == {f"{i}.nk" for i in instances}
        users = json.loads((run.run_dir / "nats.conf").read_text())["authorization"]["users"]
        assert len(users) == len(instances) + 1  # and the admin, whose seed is nowhere on disk
        other_ca = make_deployment_tls(tmp_path / "other", ["127.0.0.1"]).ca_cert

        async def connects(tls) -> bool:
            try:
                nc = await nats.connect(url, nkeys_seed=seed, tls=tls, allow_reconnect=False, connect_timeout=3)
            except (nats.errors.Error, ssl.SSLError, OSError, asyncio.TimeoutError):
                return False
            await nc.close()
            return True

        assert asyncio.run(connects(client_tls_context(str(ca))))  # the deployment's CA: in
        assert not asyncio.run(connects(None))  # plaintext: refused
        assert not asyncio.run(connects(client_tls_context(str(other_ca))))  # a server this CA did not vouch for
    finally:
        run.stop()
