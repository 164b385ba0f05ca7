"""The side channel over TLS: KV arrives intact on both backends, the bytes on the wire are not the KV's, and a
sender that does not trust the receiver's certificate, or speaks the wrong kind, fails clearly without harming
anyone else's transfers."""

import asyncio
import ssl

import msgspec
import pytest
import pytest_asyncio
import torch
from cryptography import x509

from services.cli import main as cli_main
from services.launcher.tls_files import make_deployment_tls
from shared.transfer import KVReceiver, KVSender
from shared.transfer.tls import TransferTLSError, transfer_tls
from support.waiting import eventually
from transfer_helpers import RECEIVER_OPTIONS, RawClient, Sink, kv

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_deployment_tls(tmp_path_factory.mktemp("tls"), ["127.0.0.1"], ["127.0.0.1", "localhost"])


@pytest.fixture(scope="module")
def tls(tls_files):
    return transfer_tls(str(tls_files.ca_cert), str(tls_files.transfer_cert), str(tls_files.transfer_key), environ={})


@pytest_asyncio.fixture
async def tls_receiver(tls):
    receiver = KVReceiver(**RECEIVER_OPTIONS, tls=tls)
    await receiver.start()
    yield receiver
    await receiver.stop()


def pattern_kv(layers: int, mib: int) -> torch.Tensor:
    """A recognisable payload: every float32 is 1234.5 (bytes 00 50 9A 44), `mib` MiB a layer."""
    return torch.full((layers, mib << 18), 1234.5, dtype=torch.float32)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_kv_arrives_intact_over_tls_and_one_connection_carries_the_next_transfer(tls_receiver, tls, backend):
    sender = KVSender(tls=tls)
    try:
        for n, src in enumerate((kv(4, seed=1), torch.randn(3, 2, 96, 16, 4, 64))):  # the second: ~9 MiB
            sink = Sink(src)
            ticket = tls_receiver.expect(f"t{n}", on_part=sink, total_layers=(0, src.shape[0]), deadline_s=20)
            assert ticket.endpoint.tls is True
            sent, got = await asyncio.gather(sender.send(ticket, [(0, src.shape[0], src)], backend=backend),
                                             tls_receiver.wait(f"t{n}"))
            assert sent.ok and got.ok, (sent, got)
            assert got.backend == backend
            assert torch.equal(sink.dst, src)
        assert sender.stats.connections == 1  # the kept TLS connection carried the second transfer
    finally:
        sender.close()


async def _relay(reader, writer, seen: bytearray):
    try:
        while chunk := await reader.read(1 << 16):
            seen += chunk
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.mark.parametrize("use_tls", [True, False])
async def test_what_crosses_the_network_is_ciphertext_with_tls_and_the_kv_itself_without(tls, use_tls):
    """A relay between sender and receiver records every byte; with TLS the payload's pattern is not among them
    (without, it is: the check can see it)."""
    receiver = KVReceiver(**RECEIVER_OPTIONS, tls=tls if use_tls else None)
    await receiver.start()
    seen = bytearray()
    relays = []

    async def on_connect(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", receiver.endpoint.port)
        relays.extend([asyncio.create_task(_relay(client_reader, server_writer, seen)),
                       asyncio.create_task(_relay(server_reader, client_writer, seen))])

    relay = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    sender = KVSender(tls=tls if use_tls else None)
    try:
        src = pattern_kv(2, 1)
        sink = Sink(src)
        ticket = receiver.expect("sniffed", on_part=sink, total_layers=(0, 2), deadline_s=20)
        ticket = msgspec.structs.replace(
            ticket, endpoint=msgspec.structs.replace(ticket.endpoint, port=relay.sockets[0].getsockname()[1]))
        sent, got = await asyncio.gather(sender.send(ticket, [(0, 2, src)], backend="tcp"), receiver.wait("sniffed"))
        assert sent.ok and got.ok, (sent, got)
        assert torch.equal(sink.dst, src)
        assert len(seen) > 2 << 20
        assert (bytes(src[0, :64].numpy().tobytes()) in seen) is (not use_tls)
        assert (ticket.transfer_id.encode() in seen) is (not use_tls)
    finally:
        sender.close()
        relay.close()
        for task in relays:
            task.cancel()
        await receiver.stop()


async def test_a_sender_trusting_another_ca_is_refused_and_real_transfers_go_on(tls_receiver, tls, tmp_path):
    other = make_deployment_tls(tmp_path / "other", ["127.0.0.1"], ["127.0.0.1"])
    stranger = KVSender(tls=transfer_tls(str(other.ca_cert), str(other.transfer_cert), str(other.transfer_key),
                                         environ={}))
    sender = KVSender(tls=tls)
    try:
        src = kv(2, seed=3)
        ticket = tls_receiver.expect("mistrusted", on_part=Sink(src), total_layers=(0, 2), deadline_s=20)
        refused = await stranger.send(ticket, [(0, 2, src)], backend="tcp")
        assert not refused.ok and refused.reason == "tls"
        assert "certificate" in refused.error and "not trusted" in refused.error
        sink = Sink(src)
        ticket = tls_receiver.expect("trusted", on_part=sink, total_layers=(0, 2), deadline_s=20)
        sent, got = await asyncio.gather(sender.send(ticket, [(0, 2, src)]), tls_receiver.wait("trusted"))
        assert sent.ok and got.ok and torch.equal(sink.dst, src)
    finally:
        stranger.close()
        sender.close()


async def test_a_sender_and_receiver_that_disagree_about_tls_fail_at_once_and_say_why(tls_receiver, tls, receiver):
    plain_sender, tls_sender = KVSender(), KVSender(tls=tls)
    try:
        ticket = tls_receiver.expect("wants-tls", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=20)
        result = await plain_sender.send(ticket, [(0, 1, kv(1))])
        assert not result.ok and result.reason == "tls" and "takes TLS only" in result.error
        assert result.seconds < 5  # the time is the claim: at once, not at the 20 s deadline
        ticket = receiver.expect("plain", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=20)
        result = await tls_sender.send(ticket, [(0, 1, kv(1))])
        assert not result.ok and result.reason == "tls" and "does not take TLS" in result.error
        assert plain_sender.stats.connections == tls_sender.stats.connections == 0  # nothing was dialled
    finally:
        plain_sender.close()
        tls_sender.close()


async def test_a_client_speaking_clear_text_to_a_tls_receiver_gets_nothing(tls_receiver):
    ticket = tls_receiver.expect("probe", on_part=lambda *a: None, total_layers=(0, 1), deadline_s=20)
    with pytest.raises((asyncio.IncompleteReadError, ConnectionError, TimeoutError)):
        await RawClient.connect(ticket)  # no clear-text hello ever comes
    await eventually(lambda: tls_receiver.stats.unauthenticated >= 1, what="the clear-text connection counted")
    assert tls_receiver.num_active == 1  # the expectation is untouched


async def test_a_connection_that_never_finishes_its_handshake_is_closed_at_the_handshake_deadline(tls):
    receiver = KVReceiver(handshake_timeout_s=0.3, io_timeout_s=20.0, tls=tls)
    await receiver.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", receiver.endpoint.port)
        start = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the receiver
        # The time is the claim: at the 0.3 s handshake deadline, not the 20 s I/O timeout (loose for a loaded machine).
        assert asyncio.get_running_loop().time() - start < 5
        writer.close()
        assert receiver.stats.unauthenticated == 1
    finally:
        await receiver.stop()


async def test_side_channel_tls_needs_its_three_files_and_says_which(tls_files, tmp_path):
    assert transfer_tls(environ={}) is None
    with pytest.raises(TransferTLSError, match="all three"):
        transfer_tls(str(tls_files.ca_cert), environ={})
    with pytest.raises(TransferTLSError, match="cannot use"):
        transfer_tls(str(tls_files.ca_cert), str(tmp_path / "missing.pem"), str(tls_files.transfer_key), environ={})
    env = {"SPLITSERVE_TRANSFER_TLS_CA": str(tls_files.ca_cert), "SPLITSERVE_TRANSFER_TLS_CERT":
           str(tls_files.transfer_cert), "SPLITSERVE_TRANSFER_TLS_KEY": str(tls_files.transfer_key)}
    config = transfer_tls(environ=env)
    assert config.client.verify_mode == ssl.CERT_REQUIRED and config.client.check_hostname
    assert config.server.minimum_version == ssl.TLSVersion.TLSv1_3


async def test_nats_auth_makes_the_side_channel_certificate_for_the_names_given(tmp_path, capsys):
    with pytest.raises(SystemExit, match="needs --tls-name"):
        cli_main.main(["nats-auth", str(tmp_path / "alone"), "--transfer-tls-name", "decode"])
    secrets = tmp_path / "secrets"
    assert cli_main.main(["nats-auth", str(secrets), "--tls-name", "nats", "--transfer-tls-name", "decode",
                          "--transfer-tls-name", "10.0.0.7"]) == 0
    assert "--transfer-tls-cert" in capsys.readouterr().out
    cert = x509.load_pem_x509_certificate((secrets / "tls" / "transfer.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["decode"]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert (secrets / "tls" / "transfer-key.pem").stat().st_mode & 0o077 == 0
    assert transfer_tls(str(secrets / "public" / "ca.pem"), str(secrets / "tls" / "transfer.pem"),
                        str(secrets / "tls" / "transfer-key.pem"), environ={}) is not None
    # Without --transfer-tls-name no side-channel certificate is made.
    assert cli_main.main(["nats-auth", str(tmp_path / "plain"), "--tls-name", "nats"]) == 0
    assert not (tmp_path / "plain" / "tls" / "transfer.pem").exists()


async def test_connections_reset_before_they_are_accepted_never_stop_the_tls_receiver(tls_receiver, tls):
    import socket
    import struct

    for _ in range(20):  # connect, then reset at once (SO_LINGER 0): the receiver may accept it already dead
        raw = socket.create_connection(("127.0.0.1", tls_receiver.endpoint.port))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()
    sender = KVSender(tls=tls)  # (its connection is accepted after theirs: the listen queue keeps their order)
    try:
        src = kv(2, seed=5)
        sink = Sink(src)
        ticket = tls_receiver.expect("after-resets", on_part=sink, total_layers=(0, 2), deadline_s=20)
        sent, got = await asyncio.gather(sender.send(ticket, [(0, 2, src)]), tls_receiver.wait("after-resets"))
        assert sent.ok and got.ok and torch.equal(sink.dst, src)
    finally:
        sender.close()
