"""Benchmark the KV side channel (`shared/transfer`): shm and tcp beside a plain memcpy, in one run.

For each payload size:

- memcpy: `dst.copy_(src)` of the same bytes between two warm tensors in one
  process, the physical limit of moving them once on this machine.
- shm, shm-staged, tcp: a real transfer of a paged cache's blocks, as a
  prefill worker ships a prompt's KV. The sender (`KVSender`) runs in a
  separate process, the receiver (`KVReceiver`) in this one; the payload is
  `[layers, 2, blocks, block]` (a block of 32 KiB per layer and K/V at most,
  16 tokens of 8 heads of 128 in bfloat16), sent as `BlockSlice` parts, and the
  receiver's `on_part` copies each part into the same blocks of a destination
  cache, as a decode worker's `write_kv` does. `shm`: the sender's cache lives
  in a shared-memory region, as a prefill worker's does, so the receiver copies
  the blocks straight out of it (one copy). `shm-staged`: the sender's cache is
  private, so the blocks go through a pooled segment (two copies). `tcp`: the
  blocks are gathered and streamed over loopback. `tcp-tls`: the same over
  TLS (`shared/transfer/tls.py`, certificates from a CA made for the run), what
  KV costs where it leaves a host encrypted. Latency is from the sender
  calling `send` to the receiver having copied the last part, measured on
  CLOCK_MONOTONIC (one clock for both processes on one machine); bandwidth is
  size / latency.

Each figure is the median of --repeats runs after --warmup runs (warm runs: the
sender's shared-memory pool and the receiver's mappings and buffers are reused,
as in a long-running server); `first_ms` is the very first, cold transfer of
each size. The payload is a `[layers, n]` bfloat16 tensor sent as one part
(`--parts whole`: the sender cuts it by --split-bytes) or one part per layer
(`--parts layers`, as layer-wise streaming sends it). Every transfer's bytes are
checked against the sender's.

    python -m loadtest.bench_transfer --sizes 64K,1M,16M,64M,256M --output bench_transfer.json
    python -m loadtest.bench_transfer --sizes 64K,1M --repeats 3     # quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from shared.engine.block_slice import BlockSlice
from shared.transfer import KVReceiver, KVSender, TransferTicket, host_id
from shared.transfer.checksum import as_bytes, checksum
from shared.transfer.shm import shared_zeros
from shared.transfer.tls import transfer_tls

ROOT = Path(__file__).resolve().parent.parent
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
RESULT_KEYS = ("machine", "settings", "checksums", "results")
BACKENDS = ("shm", "shm-staged", "tcp", "tcp-tls")
BLOCK_BYTES = 32 << 10  # per layer and K/V: 16 tokens x 8 KV heads x 128 dims x 2 bytes


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = _UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _UNITS else text
    size = int(float(number) * scale)
    if size < 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return size


def human(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def make_payload(size: int, layers: int, seed: int) -> torch.Tensor:
    """A paged-cache-shaped `[layers, 2, blocks, block]` bfloat16 tensor of random bits (exactly `size` bytes)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
    block_bytes = min(BLOCK_BYTES, size // layers // 2)
    return raw.view(torch.bfloat16).view(layers, 2, -1, block_bytes // 2)


def block_parts(cache: torch.Tensor, per_layer: bool) -> list:
    """All of the cache's blocks, in order, as BlockSlice parts: one per layer, or one in all."""
    blocks = tuple(range(cache.shape[2]))
    if per_layer:
        return [(i, i + 1, BlockSlice(cache[i : i + 1], blocks)) for i in range(cache.shape[0])]
    return [(0, cache.shape[0], BlockSlice(cache, blocks))]


def layers_for(size: int, wanted: int) -> int:
    layers = wanted
    while layers > 1 and (size % (layers * 2) or size // layers < 256):
        layers //= 2
    return max(layers, 1)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_checksums(size: int, repeats: int) -> dict[str, float]:
    """GB/s of memcpy and of each checksum candidate over `size` bytes."""
    import hashlib
    import zlib

    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    view = memoryview(src.numpy())
    candidates = {
        "memcpy": lambda: dst.copy_(src),
        "fold64": lambda: checksum("fold64", src),
        "crc32": lambda: zlib.crc32(view),
        "blake2b": lambda: hashlib.blake2b(view).digest(),
    }
    return {name: round(size / median_time(fn, repeats) / 1e9, 2) for name, fn in candidates.items()}


# -- the sender process ----------------------------------------------------------------------------------


async def worker_main(args: argparse.Namespace) -> None:
    """Read JSON commands on stdin, answer on the original stdout (logs go to stderr)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    torch.set_num_threads(args.threads)
    options = {"split_bytes": args.split_bytes, "max_inflight_bytes": args.inflight_bytes}
    options = {"checksum": args.checksum, **{k: v for k, v in options.items() if v}}
    sender = KVSender(**options)
    tls_sender = KVSender(**options, tls=transfer_tls(*args.tls_files.split(","), environ={})) if args.tls_files else None
    payloads: dict[str, torch.Tensor] = {}
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if cmd["cmd"] == "prepare":
                payloads.clear()
                private = make_payload(cmd["size"], cmd["layers"], cmd["seed"])
                region = shared_zeros(private.shape, private.dtype)  # as a prefill worker's cache lives
                region.copy_(private)
                payloads.update(private=private, region=region)
                replies.write(json.dumps({"sum": checksum("fold64", as_bytes(private))}) + "\n")
            elif cmd["cmd"] == "send":
                cache = payloads["region" if cmd["backend"] == "shm" else "private"]
                ticket = msgspec.convert(cmd["ticket"], TransferTicket)  # as JSON: the token in base64
                parts = block_parts(cache, per_layer=cmd["parts"] == "layers")
                start = now()
                use = tls_sender if cmd["backend"] == "tcp-tls" else sender
                result = await use.send(ticket, parts, backend=cmd["backend"].removesuffix("-staged").removesuffix("-tls"))
                replies.write(json.dumps({"t0": start, "ok": result.ok, "error": result.error,
                                          "seconds": result.seconds}) + "\n")
            elif cmd["cmd"] == "exit":
                return
    finally:
        sender.close()
        if tls_sender is not None:
            tls_sender.close()


# -- the receiving side and the driver ------------------------------------------------------------------------


class Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def call(self, cmd: dict) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=120)
        if not line:
            raise RuntimeError(f"the sender process exited ({await self.proc.wait()})")
        return json.loads(line)


async def run_transfers(args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    limits = {"max_part_bytes": max(sizes), "max_buffer_bytes": max(2 * max(sizes), 64 << 20)}
    receivers = {"plain": KVReceiver(**limits)}
    worker_args = [sys.executable, "-m", "loadtest.bench_transfer", "--worker", "--threads", str(args.threads),
                   "--checksum", args.checksum, "--split-bytes", str(args.split_bytes),
                   "--inflight-bytes", str(args.inflight_bytes)]
    tls_dir = None
    if "tcp-tls" in args.backends:
        from services.launcher.tls_files import make_deployment_tls

        tls_dir = tempfile.TemporaryDirectory(prefix="bench-transfer-tls-")
        files = make_deployment_tls(Path(tls_dir.name) / "tls", [args.host], [args.host])
        paths = (str(files.ca_cert), str(files.transfer_cert), str(files.transfer_key))
        receivers["tls"] = KVReceiver(**limits, tls=transfer_tls(*paths, environ={}))
        worker_args += ["--tls-files", ",".join(paths)]
    for receiver in receivers.values():
        await receiver.start(args.host)
    if args.hosts is not None:  # the sender on the other "host", its own shared-memory domain
        worker_args = args.hosts.command("send", worker_args)
    proc = await asyncio.create_subprocess_exec(*worker_args, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, cwd=ROOT,
                                                env={**os.environ, "SPLITSERVE_HOST_ID": "bench-sender"})
    worker = Worker(proc)
    rows = []
    try:
        for size in sizes:
            layers = layers_for(size, args.layers)
            expected_sum = (await worker.call({"cmd": "prepare", "size": size, "layers": layers, "seed": size}))["sum"]
            src = make_payload(size, layers, seed=size)
            dst = torch.zeros_like(src)
            # Round robin: each repeat times memcpy, then each backend, so that all see the same machine weather.
            copies: list[float] = []
            timings: dict[str, list[dict]] = {b: [] for b in args.backends}
            for i in range(args.warmup + args.repeats):
                start = time.perf_counter()
                dst.copy_(src)
                copy_s = time.perf_counter() - start
                runs = {b: await one_transfer(args, receivers["tls" if b == "tcp-tls" else "plain"], worker, b, size,
                                              layers, dst, expected_sum, i)
                        for b in args.backends}
                if i >= args.warmup:
                    copies.append(copy_s)
                    for b in args.backends:
                        timings[b].append(runs[b])
                elif i == 0:
                    for b in args.backends:
                        timings[b].append({**runs[b], "cold": True})
            copy_s = statistics.median(copies)
            row: dict[str, Any] = {"size": size, "layers": layers,
                                   "memcpy": {"gbps": size / copy_s / 1e9, "latency_ms": copy_s * 1e3}}
            for b in args.backends:
                first = timings[b][0]["latency"] * 1e3
                timed = [t for t in timings[b] if not t.get("cold")]
                latency = statistics.median(t["latency"] for t in timed)
                row[b] = {"gbps": size / latency / 1e9, "latency_ms": latency * 1e3, "first_ms": first,
                          "sender_ms": statistics.median(t["sender_s"] for t in timed) * 1e3,
                          "latencies_ms": [round(t["latency"] * 1e3, 4) for t in timed],
                          "ratio_to_memcpy": [round(c / t["latency"], 4) for c, t in zip(copies, timed)]}
            del src
            rows.append(row)
            print_row(row, args.backends, flush=True)
    finally:
        try:
            await worker.call({"cmd": "exit"})
        except Exception:
            pass
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), timeout=10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for receiver in receivers.values():
            await receiver.stop()
        if tls_dir is not None:
            tls_dir.cleanup()
    return rows


async def one_transfer(args, receiver: KVReceiver, worker: Worker, backend: str, size: int, layers: int,
                       dst: torch.Tensor, expected_sum: int, i: int) -> dict[str, float]:
    """One transfer into `dst`; its latency (send called -> last part copied) and the sender's own time."""
    verify = i == 0 or i == args.warmup + args.repeats - 1
    if verify:
        dst.zero_()
    finished = {"at": 0.0}

    def on_part(start: int, end: int, part) -> None:
        if isinstance(part, BlockSlice):
            part.copy_into(dst[start:end], part.block_ids)
        else:
            dst[start:end].copy_(part)
        finished["at"] = now()

    tid = f"bench-{backend}-{size}-{i}"
    ticket = receiver.expect(tid, on_part=on_part, total_layers=(0, dst.shape[0]), deadline_s=args.deadline_s)
    data = msgspec.to_builtins(ticket)
    reply, result = await asyncio.gather(
        worker.call({"cmd": "send", "size": size, "ticket": data, "backend": backend, "parts": args.parts}),
        receiver.wait(tid),
    )
    if not (reply["ok"] and result.ok):
        raise RuntimeError(f"{backend} transfer of {human(size)} failed: sender {reply['error']}, "
                           f"receiver {result.error}")
    if verify:
        if checksum("fold64", as_bytes(dst)) != expected_sum:
            raise RuntimeError(f"{backend} transfer of {human(size)} delivered different bytes")
    return {"latency": finished["at"] - reply["t0"], "sender_s": reply["seconds"]}


def print_header(backends: list[str]) -> None:
    cols = [f"{'size':>6}", f"{'memcpy GB/s':>11}", f"{'ms':>8}"]
    for b in backends:
        cols += [f"{b + ' GB/s':>9}", f"{'ms':>8}", f"{'%memcpy':>7}", f"{'first ms':>8}"]
    print("  ".join(cols))


def print_row(row: dict, backends: list[str], flush: bool = False) -> None:
    memcpy = row["memcpy"]
    cols = [f"{human(row['size']):>6}", f"{memcpy['gbps']:>11.2f}", f"{memcpy['latency_ms']:>8.3f}"]
    for b in backends:
        r = row[b]
        cols += [f"{r['gbps']:>9.2f}", f"{r['latency_ms']:>8.3f}", f"{100 * r['gbps'] / memcpy['gbps']:>6.0f}%",
                 f"{r['first_ms']:>8.2f}"]
    print("  ".join(cols), flush=flush)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64K,1M,16M,64M,256M",
                        help="comma-separated payload sizes (K, M, G suffixes: powers of 1024)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: " + ", ".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=7, help="timed transfers per size and backend (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed transfers before them")
    parser.add_argument("--layers", type=int, default=32, help="layers in the payload (fewer for tiny sizes)")
    parser.add_argument("--parts", choices=("whole", "layers"), default="whole",
                        help="send the payload as one part, or one part per layer")
    parser.add_argument("--checksum", choices=("fold64", "crc32"), default="fold64")
    parser.add_argument("--split-bytes", type=parse_size, default=0, help="sender's split size (0: its default)")
    parser.add_argument("--inflight-bytes", type=parse_size, default=0,
                        help="sender's in-flight cap (0: its default)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both processes")
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--checksum-bytes", type=parse_size, default=64 << 20,
                        help="payload of the checksum speed measurement (0: skip it)")
    parser.add_argument("--netns", action="store_true",
                        help="the sender on another \"host\": a network namespace joined to the receiver's by a "
                             "veth pair and a bridge (loadtest/netns.py; needs root; tcp and tcp-tls only)")
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tls-files", help=argparse.SUPPRESS)  # the worker's CA,cert,key for tcp-tls
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        asyncio.run(worker_main(args))
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1024:
        raise SystemExit("--sizes must list sizes of at least 1K")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not set(args.backends) <= set(BACKENDS):
        raise SystemExit(f"unknown backend in {args.backends}")
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    args.host, args.hosts = "127.0.0.1", None
    if args.netns:
        if not set(args.backends) <= {"tcp", "tcp-tls"}:
            raise SystemExit("--netns: the hosts share no memory; give --backends tcp,tcp-tls")
        from loadtest.netns import Hosts

        args.hosts = Hosts(["recv", "send"])
        args.hosts.thread_in("recv")  # this thread (the receiver's event loop) lives on the receiving host
        args.host = args.hosts.address["recv"]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        checksum_speeds = {}
        if args.checksum_bytes:
            checksum_speeds = measure_checksums(args.checksum_bytes, max(3, args.repeats))
            print(f"checksums over {human(args.checksum_bytes)} (GB/s): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in checksum_speeds.items()))
        print_header(args.backends)
        rows = asyncio.run(run_transfers(args, sizes))
    finally:
        torch.set_num_threads(threads_before)
        if args.hosts is not None:
            args.hosts.close()
    results = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch_version": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": args.threads,
                    "host_id": host_id()},
        "settings": {"sizes": sizes, "backends": args.backends, "repeats": args.repeats, "warmup": args.warmup,
                     "parts": args.parts, "checksum": args.checksum, "split_bytes": args.split_bytes,
                     "inflight_bytes": args.inflight_bytes, "netns": args.netns, "command": " ".join(sys.argv)},
        "checksums": {"bytes": args.checksum_bytes, "gbps": checksum_speeds},
        "results": rows,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
