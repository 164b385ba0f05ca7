"""Real KV transfers while a flood of connections hits the receiver's side-channel port (issue 13, item 5).

A decode worker's side channel listens on a TCP port that anyone on the network
can reach. This runs, on one machine:

- the receiver (`KVReceiver`, in this process, as a decode worker holds it);
- a sender (`KVSender`) in a separate process, shipping `--transfers` payloads
  of `--size` bytes over tcp, one after another, each with `--deadline` seconds,
  each on a new connection (the case a flood attacks: a peer not yet connected);
- with `--flooders N`, a separate process holding N connections to the port
  that never authenticate: each connects, waits silently until the receiver
  closes it, and reconnects at once (the attack that used to fill every
  connection slot and fail every real transfer). With `--tls` the receiver
  and sender speak TLS (certificates from a CA made for the run) and every
  flood connection first completes a TLS handshake, so each one costs the
  receiver a key exchange and a signature before it falls silent.

For each phase (no flood, then flood) it reports how many transfers met their
deadline and their latency (p50/p99, from `expect` to the last byte applied),
plus the receiver's counters (connections refused, handshakes timed out or
evicted).

    python -m loadtest.bench_side_channel_flood --flooders 300 --output loadtest/results/side_channel_flood.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from services.launcher.tls_files import make_deployment_tls
from shared.transfer import KVReceiver, KVSender, TransferTicket
from shared.transfer.tls import transfer_tls

ROOT = Path(__file__).resolve().parent.parent


async def sender_main(tls_files: str | None) -> None:
    """Role `sender`: read tickets (JSON lines) on stdin, send the payload, answer with the result."""
    tls = transfer_tls(*tls_files.split(","), environ={}) if tls_files else None
    sender = KVSender(max_idle_connections=0, tls=tls)  # every transfer on a new connection, as a new peer's would be
    out = sys.stdout
    sys.stdout = sys.stderr  # logs must not mix with the answers
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        ticket = msgspec.convert(cmd["ticket"], TransferTicket)  # as JSON: the token in base64
        payload = torch.ones(cmd["layers"], cmd["size"] // cmd["layers"] // 4)
        result = await sender.send(ticket, [(0, cmd["layers"], payload)], backend="tcp")
        out.write(json.dumps({"ok": result.ok, "error": result.error}) + "\n")
        out.flush()
    sender.close()


async def flood_main(host: str, port: int, clients: int, use_tls: bool) -> None:
    """Role `flood`: `clients` connections that never authenticate, each reopened as soon as it is closed."""
    opened = 0
    context = None
    if use_tls:  # a handshake completed, whoever the receiver is: the most a flooder can make it spend
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

    async def one() -> None:
        nonlocal opened
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port, ssl=context)
            except (OSError, ssl.SSLError):
                await asyncio.sleep(0.01)
                continue
            opened += 1
            try:
                while await reader.read(65536):  # swallow the hello; say nothing back
                    pass
            except OSError:
                pass
            writer.close()

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            print(json.dumps({"opened": opened}), flush=True)

    await asyncio.gather(report(), *(one() for _ in range(clients)))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_phase(args, receiver: KVReceiver, sender: asyncio.subprocess.Process, name: str) -> dict:
    latencies, failures = [], []
    layers = 16
    before = receiver.stats.snapshot()
    for i in range(args.transfers):
        transfer_id = f"{name}-{i}"
        started = time.perf_counter()
        ticket = receiver.expect(transfer_id, on_part=lambda *_: None, total_layers=(0, layers),
                                 deadline_s=args.deadline)
        wire = msgspec.to_builtins(ticket)
        sender.stdin.write((json.dumps({"ticket": wire, "size": args.size, "layers": layers}) + "\n").encode())
        await sender.stdin.drain()
        result = await receiver.wait(transfer_id)
        answer = json.loads(await asyncio.wait_for(sender.stdout.readline(), args.deadline + 5))
        if result.ok:
            latencies.append(time.perf_counter() - started)
        else:
            failures.append(result.error or result.reason)
        if not answer["ok"] and result.ok:
            failures.append(f"sender: {answer['error']}")
    after = receiver.stats.snapshot()
    counters = {key: after.get(key, 0) - before.get(key, 0)  # (.get: also runs against older receivers)
                for key in ("connections", "refused_connections", "unauthenticated", "evicted_handshakes")}
    return {"phase": name, "transfers": args.transfers, "met_deadline": len(latencies),
            "failures": failures[:5], "p50_ms": _ms(percentile(latencies, 0.5)),
            "p99_ms": _ms(percentile(latencies, 0.99)), "max_ms": _ms(max(latencies, default=None)),
            "receiver": counters}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def main_async(args, tls_dir: Path | None) -> dict:
    tls_args, tls = [], None
    if tls_dir is not None:
        files = make_deployment_tls(tls_dir, ["127.0.0.1"], ["127.0.0.1"])
        paths = (str(files.ca_cert), str(files.transfer_cert), str(files.transfer_key))
        tls, tls_args = transfer_tls(*paths, environ={}), ["--tls-files", ",".join(paths)]
    receiver = KVReceiver(**({"max_handshakes": args.max_handshakes} if args.max_handshakes else {}),
                          **({"handshake_timeout_s": args.handshake_timeout} if args.handshake_timeout else {}),
                          tls=tls)
    await receiver.start("127.0.0.1", 0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    me = [sys.executable, "-m", "loadtest.bench_side_channel_flood"]
    sender = await asyncio.create_subprocess_exec(*me, "--role", "sender", *tls_args, stdin=asyncio.subprocess.PIPE,
                                                  stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env)
    flood = None
    phases = []
    try:
        await run_phase(argparse.Namespace(**{**vars(args), "transfers": 1}), receiver, sender, "warm-up")
        phases.append(await run_phase(args, receiver, sender, "quiet"))
        if args.flooders:
            flood = await asyncio.create_subprocess_exec(
                *me, "--role", "flood", "--port", str(receiver.endpoint.port), "--flooders", str(args.flooders),
                *(["--tls"] if tls is not None else []), stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env)
            opened = 0
            while opened < args.flooders:  # every flooder has a connection before the real transfers start
                opened = json.loads(await asyncio.wait_for(flood.stdout.readline(), 30))["opened"]
            phase = await run_phase(args, receiver, sender, "flood")
            phase["flood_connections_opened"] = json.loads(await asyncio.wait_for(flood.stdout.readline(), 30))["opened"]
            phases.append(phase)
    finally:
        for proc in (flood, sender):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
        await receiver.stop()
    return {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {"transfers": args.transfers, "size_bytes": args.size, "deadline_s": args.deadline,
                         "flooders": args.flooders, "backend": "tcp", "tls": tls is not None,
                         "receiver": {"max_connections": receiver.max_connections,
                                      "max_handshakes": getattr(receiver, "max_handshakes", None),
                                      "handshake_timeout_s": receiver.handshake_timeout_s}},
            "phases": phases}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["main", "sender", "flood"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--flooders", type=int, default=300, help="connections that never authenticate (default: 300)")
    parser.add_argument("--transfers", type=int, default=30, help="real transfers per phase (default: 30)")
    parser.add_argument("--size", type=int, default=8 << 20, help="bytes per transfer (default: 8 MiB)")
    parser.add_argument("--deadline", type=float, default=30.0, help="each transfer's deadline, seconds (default: 30)")
    parser.add_argument("--max-handshakes", type=int, help="the receiver's bound on unauthenticated connections "
                        "(default: its own; 100000 never sheds one, as before the bound existed)")
    parser.add_argument("--handshake-timeout", type=float, help="the receiver's handshake deadline (default: its own)")
    parser.add_argument("--tls", action="store_true", help="the side channel over TLS; flooders complete handshakes")
    parser.add_argument("--tls-files", help=argparse.SUPPRESS)  # the sender's CA,cert,key
    parser.add_argument("--output", help="write the results as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "sender":
        asyncio.run(sender_main(args.tls_files))
        return 0
    if args.role == "flood":
        asyncio.run(flood_main("127.0.0.1", args.port, args.flooders, args.tls))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-flood-tls-") as scratch:
        results = asyncio.run(main_async(args, Path(scratch) / "tls" if args.tls else None))
    text = json.dumps(results, indent=2)
    for phase in results["phases"]:
        print(f"{phase['phase']:>6}: {phase['met_deadline']}/{phase['transfers']} met their deadline, "
              f"p50 {phase['p50_ms']} ms, p99 {phase['p99_ms']} ms, receiver {phase['receiver']}")
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if all(p["met_deadline"] == p["transfers"] for p in results["phases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
