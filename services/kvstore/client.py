"""A worker's side of the kv-store: lookup, put and get against one instance (`placement` says which).

Nothing here ever fails a request: a kv-store that is slow, full or down makes
`lookup` answer 0, `put` and `get` answer False, each within its deadline, and
the miss is counted by reason (the worker computes instead).
"""

import secrets
import time
from collections import Counter
from collections.abc import Callable

import nats.errors
from opentelemetry import trace
import torch

from contracts import KVStoreGet, KVStoreLookup, KVStorePut, KVStoreReply, Sender, Subjects
from contracts.codec import ContractError
from shared.bus.subscribe import decode
from shared.telemetry.tracing import inject
from shared.transfer import KVReceiver, KVSender


class KVStoreClient:
    def __init__(self, *, nc, subjects: Subjects, receiver: KVReceiver, sender: KVSender, model_fingerprint: bytes,
                 me: Sender, timeout_s: float = 5.0):
        """`me`: the worker, as its requests are signed (the store serves only registered workers)."""
        self.nc = nc
        self.me = me
        self.model_fingerprint = model_fingerprint  # the worker's model: what it puts is stored as that model's
        self.subjects = subjects
        self.receiver = receiver
        self.sender = sender
        self.timeout_s = timeout_s
        self.misses: Counter[str] = Counter()

    async def _ask(self, instance: str, endpoint: str, message) -> KVStoreReply | None:
        try:
            reply = await self.nc.request(self.me.signs(self.subjects.kvstore(instance, endpoint)), message.encode(),
                                          timeout=self.timeout_s, headers=inject())
            answer = decode(reply.data, KVStoreReply)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            self.misses[f"{endpoint}_unreachable"] += 1
            return None
        except ContractError:
            self.misses[f"{endpoint}_bad_reply"] += 1
            return None
        if not answer.ok:
            self.misses[f"{endpoint}_refused"] += 1
            return None
        return answer

    async def lookup(self, instance: str, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the instance holds (0 when it cannot say)."""
        if not hashes:
            return 0
        answer = await self._ask(instance, "lookup", KVStoreLookup(hashes=list(hashes),
                                                                   model_fingerprint=self.model_fingerprint))
        return answer.num_hit if answer is not None else 0

    async def put(self, instance: str, hashes: list[bytes], blocks: torch.Tensor) -> bool:
        """Store `blocks[i]` under `hashes[i]`; True once the instance received them all (it stores them right after:
        a lookup at once may not see them yet)."""
        if len(hashes) != blocks.shape[0] or not hashes:
            raise ValueError(f"{len(hashes)} hashes for {blocks.shape[0]} blocks")
        deadline_ms = int((time.time() + self.timeout_s) * 1000)
        answer = await self._ask(instance, "put", KVStorePut(
            transfer_id=secrets.token_hex(8), hashes=list(hashes), dtype=str(blocks.dtype).removeprefix("torch."),
            block_shape=list(blocks.shape[1:]), deadline_ms=deadline_ms, model_fingerprint=self.model_fingerprint))
        if answer is None:
            return False
        if answer.ticket is None:
            self.misses["put_bad_reply"] += 1
            return False
        result = await self.sender.send(answer.ticket, [(0, len(hashes), blocks)])
        if not result.ok:
            self.misses["put_transfer"] += 1
        return result.ok

    async def get(self, instance: str, hashes: list[bytes],
                  on_blocks: Callable[[int, int, torch.Tensor], None]) -> bool:
        """Fetch the blocks of `hashes`: `on_blocks(first, end, tensor)` gets blocks [first, end) as they arrive
        (a view: copy it, e.g. into the paged cache). True once all arrived."""
        transfer_id = f"kvget-{secrets.token_hex(8)}"
        ticket = self.receiver.expect(transfer_id, on_part=on_blocks, total_layers=(0, len(hashes)),
                                      deadline_s=self.timeout_s)
        try:
            answer = await self._ask(instance, "get", KVStoreGet(hashes=list(hashes), ticket=ticket,
                                                                 deadline_ms=int(ticket.deadline_unix_s * 1000),
                                                                 model_fingerprint=self.model_fingerprint))
            if answer is None:
                return False
            result = await self.receiver.wait(transfer_id)
        finally:
            self.receiver.cancel(transfer_id)  # when cancelled (or refused): no late block reaches `on_blocks`
        trace.get_current_span().set_attributes(result.span_attributes())
        if not result.ok:
            self.misses["get_transfer"] += 1
        return result.ok

    async def close(self) -> None:
        """Stop the client's side channel (its receiver and sender are its own)."""
        await self.receiver.stop()
        self.sender.close()

