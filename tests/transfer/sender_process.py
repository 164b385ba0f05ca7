"""A KV sender in a process of its own, for the side-channel tests.

    python sender_process.py '{"ticket": {... token as hex ...}, "backend": "shm", "layers": 4, "seed": 1,
                               "dtype": "bfloat16", "mode": "all" | "hang", "close": true}'

Sends `kv(layers, dtype, seed)` one layer per part and prints `RESULT <json>`.
With "close": false it exits without closing its sender (its pool is cleaned at exit).
Mode "hang" hands its sender the first layer, prints `SENT-FIRST` once the sender asks for the next one, then waits
forever (the test kills it).
"""

import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import torch  # noqa: E402

from shared.transfer import KVSender, TransferTicket  # noqa: E402
from transfer_helpers import kv  # noqa: E402


async def main(spec: dict) -> None:
    ticket = msgspec.convert(spec["ticket"], TransferTicket)  # as JSON: the token in base64
    src = kv(spec["layers"], getattr(torch, spec["dtype"]), seed=spec["seed"])
    sender = KVSender()

    async def parts():
        for layer in range(spec["layers"]):
            yield layer, layer + 1, src[layer : layer + 1]
            if spec["mode"] == "hang":
                print("SENT-FIRST", flush=True)
                await asyncio.sleep(3600)

    try:
        result = await sender.send(ticket, parts(), backend=spec["backend"])
    finally:
        if spec.get("close", True):
            sender.close()
    print("RESULT " + json.dumps({"ok": result.ok, "error": result.error, "reason": result.reason,
                                  "backend": result.backend, "num_bytes": result.num_bytes}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
