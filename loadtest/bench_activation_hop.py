"""How a pipeline hop should carry a step's activations: inline in the NATS message, or over the side channel.

One hop as the stage services make it (`services/stage/link.py`): `send` on
one `ActivationLink`, `next` on another, in one process, through a real
`nats-server` (the embedded one `splitserve up` starts) and the real side
channel. For each payload size, the median latency from `send` to the tensor
in hand, both ways: inline (the message carries the bytes) and side channel
(a ticket request, the message, then the transfer; `--transport` picks shm or
tcp). The crossover picks `--inline-activation-bytes` (default 256 KiB; a
decode step of 8 sequences of a 4096-wide float32 model is 128 KiB, a prefill
chunk of 512 tokens 8 MiB; NATS's default max payload is 1 MiB).

    python -m loadtest.bench_activation_hop --output loadtest/results/activation_hop_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from contracts import StageActivation, Subjects
from loadtest.bench_transfer import human, parse_size
from services.launcher.nats_server import EmbeddedNats
from services.stage.link import ActivationLink
from shared.engine.step_batch import StepBatch
from shared.transfer import KVReceiver, KVSender

RESULT_KEYS = ("settings", "results")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4K,32K,128K,256K,512K,1M,4M,16M")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    parser.add_argument("--output")
    return parser


# The hop carries the tensor only: the step it belongs to is empty.
_NO_BATCH = StepBatch.empty(block_size=16)


async def measure(args) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-hop-"))
    import nats

    with EmbeddedNats(run_dir) as server:
        url = server.start()
        subjects = Subjects("benchhop")
        nc_a, nc_b = await nats.connect(url), await nats.connect(url)
        receivers = [KVReceiver(), KVReceiver()]
        for receiver in receivers:
            await receiver.start()
        links = {}
        for name, nc, receiver in (("a", nc_a, receivers[0]), ("b", nc_b, receivers[1])):
            links[name] = ActivationLink(nc=nc, subjects=subjects, instance_id=name, receiver=receiver,
                                         sender=KVSender(), transport=args.transport, hop_timeout_s=30)
            await links[name].start()
        rows = []
        try:
            for size in [parse_size(s) for s in args.sizes.split(",")]:
                tensor = torch.randn(size // 4)
                row = {"size": size}
                for path, inline_bytes in (("inline", 1 << 62), ("side_channel", 0)):
                    if path == "inline" and size > (nc_a.max_payload - 4096):
                        row[path] = None  # over the server's max payload
                        continue
                    links["a"].inline_bytes = inline_bytes
                    times = []
                    for i in range(args.repeats + 2):
                        message = StageActivation(step_id=i, head="b", route=["b"], batch=_NO_BATCH, kind="hidden",
                                                  deadline_ms=int(time.time() * 1000) + 30_000)
                        started = time.perf_counter()
                        await links["a"].send("b", message, tensor)
                        incoming = await asyncio.wait_for(links["b"].next(), 30)  # it was refused, or lost
                        elapsed = time.perf_counter() - started
                        if incoming.error is not None or not torch.equal(incoming.tensor, tensor):
                            raise RuntimeError(f"{path} hop of {human(size)} failed: {incoming.error}")
                        if i >= 2:
                            times.append(elapsed)
                    row[path] = {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}
                rows.append(row)
                inline = row["inline"]["median_ms"] if row["inline"] else float("nan")
                print(f"{human(size):>6}  inline {inline:8.3f} ms   side channel "
                      f"{row['side_channel']['median_ms']:8.3f} ms", flush=True)
        finally:
            for link in links.values():
                await link.stop()
                link.sender.close()
            for receiver in receivers:
                await receiver.stop()
            await nc_a.close()
            await nc_b.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = asyncio.run(measure(args))
    if args.output:
        Path(args.output).write_text(json.dumps({"settings": vars(args) | {"command": " ".join(sys.argv)},
                                                 "results": rows}, indent=2))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
