"""How pipeline stages hand a step's tensor to the next hop (the next stage, or the head for logits).

Every hop is one `StageActivation` message on NATS, on the receiver's own
subject, so a stage takes steps in the order they were sent. The tensor rides
inside it when it is small (a decode step's hidden states: a few KiB per
sequence); a bigger one (a prefill chunk's) goes over the KV side channel:
the sender first asks the receiver for a ticket (`StageTicketRequest`), then
publishes the message naming the transfer and streams the bytes, while the
receiver, taking messages in order, waits for that transfer when it comes to
it. Every wait is bounded by the hop deadline.
"""

import asyncio
import dataclasses
import secrets
import time
from collections import OrderedDict

import msgspec
import torch

from contracts import StageActivation, StageTicketReply, StageTicketRequest, Subjects
from contracts.codec import ContractError
from services.common.identity import now_ms
from shared.bus.subscribe import decode, subscribe_typed
from shared.telemetry.logging import get_logger
from shared.transfer import KVReceiver, KVSender, TransferTicket
from shared.transfer.wire import DTYPES

log = get_logger(__name__)

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclasses.dataclass(slots=True)
class Incoming:
    message: StageActivation
    tensor: torch.Tensor | None
    error: str | None


class ActivationLink:
    """One process's end of the pipeline's hops: `send` to another instance, `next` from whoever sent here.

    `inline_bytes`: tensors up to this size ride NATS (keep it well under the
    server's max payload). `transport`: the side channel's backend for bigger
    ones (auto, shm, tcp). `hop_timeout_s`: a ticket request or a transfer
    that takes longer fails the step. `max_pending`: messages received and not
    yet taken; more fail at once (a head keeps at most its micro-batches in
    flight, so this only trips when something is wrong).
    """

    def __init__(self, *, nc, subjects: Subjects, instance_id: str, receiver: KVReceiver, sender: KVSender,
                 inline_bytes: int = 256 << 10, transport: str = "auto", hop_timeout_s: float = 30.0,
                 max_pending: int = 256):
        self.nc = nc
        self.subjects = subjects
        self.instance_id = instance_id
        self.receiver = receiver
        self.sender = sender
        self.inline_bytes = inline_bytes
        self.transport = transport
        self.hop_timeout_s = hop_timeout_s
        self._pending: asyncio.Queue[tuple[StageActivation, asyncio.Future]] = asyncio.Queue(max_pending)
        self.max_pending = max_pending
        self._received: OrderedDict[str, torch.Tensor] = OrderedDict()  # arrived, not yet taken by `next`
        self._send_order: dict[str, asyncio.Lock] = {}  # per destination: messages leave in the order sent
        self._sends: set[asyncio.Task] = set()
        self.stats = {"inline_bytes_sent": 0, "side_channel_bytes_sent": 0, "inline_messages_sent": 0,
                      "side_channel_transfers_sent": 0, "failed_sends": 0, "overflowed": 0}
        self._subscriptions = []

    async def start(self) -> None:
        self._subscriptions = [
            await self.nc.subscribe(self.subjects.stage_activations(self.instance_id), cb=self._on_activation),
            await subscribe_typed(self.nc, self.subjects.stage_tickets(self.instance_id), StageTicketRequest,
                                  self._on_ticket_request),
        ]
        await self.nc.flush()  # the server knows the subscriptions before anyone is told this link is up

    async def stop(self) -> None:
        for sub in self._subscriptions:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be closing already
                pass
        for task in list(self._sends):
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)  # their leases are back before the sender closes

    # ---- receiving ---------------------------------------------------------------------------
    async def next(self) -> Incoming:
        """The next message in arrival order, with its tensor (or why it could not be had)."""
        message, tensor_future = await self._pending.get()
        try:
            tensor = await tensor_future
        except Exception as exc:
            return Incoming(message, None, str(exc))
        return Incoming(message, tensor, None)

    async def _on_activation(self, msg) -> None:
        try:
            activation = decode(msg.data, StageActivation)
        except ContractError as exc:
            log.warning("malformed stage activation dropped", error=str(exc))
            return
        loop = asyncio.get_running_loop()
        if activation.transfer_id:
            future = loop.create_task(self._wait_transfer(activation.transfer_id))
        else:
            future = loop.create_future()
            try:
                # A tensor came when it has a dtype (possibly empty: logits of a step that samples no row).
                future.set_result(_inline_tensor(activation) if activation.dtype else None)
            except ValueError as exc:
                future.set_exception(exc)
        try:
            self._pending.put_nowait((activation, future))
        except asyncio.QueueFull:
            self.stats["overflowed"] += 1
            future.cancel()
            if activation.head != self.instance_id:  # a full head drops it: the step fails by its deadline
                await self.fail_to_head(activation, f"{self.instance_id} has too many steps waiting")

    async def _wait_transfer(self, transfer_id: str) -> torch.Tensor:
        try:
            result = await self.receiver.wait(transfer_id)
        except KeyError:
            raise RuntimeError(f"no ticket was handed out for transfer {transfer_id}") from None
        tensor = self._received.pop(transfer_id, None)
        if not result.ok or tensor is None:
            raise RuntimeError(f"the activation transfer failed: {result.error}")
        return tensor

    async def _on_ticket_request(self, request: StageTicketRequest, msg) -> None:
        deadline_s = max(0.1, min(self.hop_timeout_s, (request.deadline_ms - now_ms()) / 1000))
        received = self._received

        def keep(start: int, end: int, part: torch.Tensor) -> None:  # a view, valid during the call: copy it
            received[request.transfer_id] = part[0].clone()
            while len(received) > self.max_pending:  # whose message never came (dropped): not kept forever
                received.popitem(last=False)

        try:
            ticket = self.receiver.expect(request.transfer_id, on_part=keep, total_layers=(0, 1), deadline_s=deadline_s)
            reply = StageTicketReply(ok=True, ticket=ticket)
        except (ValueError, RuntimeError) as exc:
            reply = StageTicketReply(ok=False, error=str(exc))
        if msg.reply:
            await msg.respond(reply.encode())

    # ---- sending ----------------------------------------------------------------------------
    async def send(self, to: str, activation: StageActivation, tensor: torch.Tensor | None) -> None:
        """Publish `activation` to instance `to` with `tensor`; raises if the hop cannot even start.

        Messages to one destination leave in the order `send` was called, a big one's ticket round trip
        included: a stage must run steps in the order the head started them (a step of a request aborted
        meanwhile must not land after the next step that reuses its blocks).
        """
        order = self._send_order.setdefault(to, asyncio.Lock())
        async with order:
            await self._send(to, activation, tensor)

    async def _send(self, to: str, activation: StageActivation, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            await self.nc.publish(self.subjects.stage_activations(to), activation.encode())
            return
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        activation = msgspec.structs.replace(activation, dtype=_DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape))
        if nbytes <= self.inline_bytes:
            activation.data = tensor.view(-1).view(torch.uint8).numpy().tobytes()
            await self.nc.publish(self.subjects.stage_activations(to), activation.encode())
            self.stats["inline_messages_sent"] += 1
            self.stats["inline_bytes_sent"] += nbytes
            return
        transfer_id = f"{self.instance_id}-{activation.step_id}-{activation.kind}-{secrets.token_hex(4)}"
        deadline_ms = min(activation.deadline_ms, now_ms() + int(self.hop_timeout_s * 1000))
        reply = await self.nc.request(
            self.subjects.stage_tickets(to),
            StageTicketRequest(transfer_id=transfer_id, nbytes=nbytes, deadline_ms=deadline_ms).encode(),
            timeout=self.hop_timeout_s,
        )
        answer = decode(reply.data, StageTicketReply)
        if not answer.ok or answer.ticket is None:
            raise RuntimeError(f"{to} refused the activation transfer: {answer.error or 'no ticket'}")
        ticket = answer.ticket
        activation.transfer_id = transfer_id
        await self.nc.publish(self.subjects.stage_activations(to), activation.encode())
        task = asyncio.create_task(self._transfer(ticket, tensor, activation))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _transfer(self, ticket: TransferTicket, tensor: torch.Tensor, activation: StageActivation) -> None:
        started = time.perf_counter()
        result = await self.sender.send(ticket, [(0, 1, tensor[None])], backend=self.transport)
        if result.ok:
            self.stats["side_channel_transfers_sent"] += 1
            self.stats["side_channel_bytes_sent"] += result.num_bytes
            return
        self.stats["failed_sends"] += 1
        log.warning("activation transfer failed", step_id=activation.step_id, error=result.error,
                    seconds=round(time.perf_counter() - started, 3))
        await self.fail_to_head(activation, f"{self.instance_id} could not ship step {activation.step_id}: "
                                            f"{result.error}")

    async def fail_to_head(self, activation: StageActivation, error: str) -> None:
        """Tell the step's head that the step failed here (it ends the step's requests)."""
        failure = msgspec.structs.replace(activation, route=[], kind="error", error=error[:2000], data=b"",
                                      transfer_id="", dtype="", shape=[])
        try:
            await self.nc.publish(self.subjects.stage_activations(activation.head), failure.encode())
        except Exception as exc:  # the head finds out by its step deadline instead
            log.warning("could not report a failed step", step_id=activation.step_id, error=repr(exc))


def _inline_tensor(activation: StageActivation) -> torch.Tensor:
    dtype = DTYPES.get(activation.dtype)
    if dtype is None:
        raise ValueError(f"activation dtype {activation.dtype!r} is unknown")
    numel = 1
    for dim in activation.shape:
        numel *= dim
    if numel * dtype.itemsize != len(activation.data):
        raise ValueError(f"{len(activation.data)} bytes are not a {activation.dtype} tensor of shape {activation.shape}")
    if numel == 0:
        return torch.empty(activation.shape, dtype=dtype)
    return torch.frombuffer(bytearray(activation.data), dtype=dtype).view(activation.shape)
