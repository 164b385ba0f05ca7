"""Messages on the bus as a test sees them: a second subscriber beside the service's (core NATS hands each
message to both). `TokenTap` reads what the workers stream to a gateway, so a test compares the token ids a
deployment produced, not text decoded from them, and sees each chunk as often as it was sent.
"""

import asyncio
import threading

import nats

from contracts import ContractError, Subjects, TokenChunk
from support.waiting import server_has


def request_id_of(body: dict) -> str:
    """The bus request id of an OpenAI response body or stream chunk (`cmpl-ID`, `chatcmpl-ID`)."""
    return body["id"].split("-", 1)[1]


class BusTap:
    """Every message of type `message_cls` published on `subject` (wildcards allowed), decoded, in arrival order;
    a message of another type is skipped. Listens on its own connection and thread until `close()`."""

    def __init__(self, nats_url: str, subject: str, message_cls):
        self.message_cls = message_cls
        self._messages: list = []
        self._seen = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bus-tap", daemon=True)
        self._thread.start()
        self._nc = asyncio.run_coroutine_threadsafe(self._subscribe(nats_url, subject), self._loop).result(10)

    async def _subscribe(self, nats_url: str, subject: str):
        nc = await nats.connect(nats_url)
        await nc.subscribe(subject, cb=self._on_msg)
        await server_has(nc)  # subscribed at the server before anything the test sends
        return nc

    async def _on_msg(self, msg) -> None:
        try:
            message = self.message_cls.decode(msg.data)
        except ContractError:
            return
        with self._seen:
            self._messages.append(message)
            self._seen.notify_all()

    def messages(self) -> list:
        with self._seen:
            return list(self._messages)

    def wait_for(self, predicate, timeout_s: float, what: str, after: int = 0):
        """The first message from the `after`th on that `predicate` holds for, waiting for it up to `timeout_s`."""
        with self._seen:
            found = self._seen.wait_for(lambda: next((m for m in self._messages[after:] if predicate(m)), None),
                                        timeout_s)
            assert found is not None, f"{what}: {self._messages}"
            return found

    def caught_up(self) -> None:
        """Until the tap holds every message the server took before now (from a publisher that has since answered
        the test, say): a round trip on its connection comes back after them."""
        asyncio.run_coroutine_threadsafe(server_has(self._nc), self._loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._nc.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class TokenTap(BusTap):
    """The token chunks the workers send a gateway (an Assignment or a RequestFailed there is skipped)."""

    def __init__(self, nats_url: str, namespace: str, gateway_id: str = "gateway-0"):
        super().__init__(nats_url, Subjects(namespace).tokens_wildcard(gateway_id), TokenChunk)

    def chunks(self, request_id: str, timeout_s: float = 10.0) -> list[TokenChunk]:
        """The request's chunks as they came, once its finished one has."""
        self.wait_for(lambda c: c.request_id == request_id and c.finished, timeout_s,
                      f"no finished token chunk for {request_id}")
        return [c for c in self.messages() if c.request_id == request_id]

    def token_ids(self, body_or_request_id: dict | str) -> list[int]:
        """The request's output token ids; asserts each chunk came exactly once, in order, the last one finished."""
        request_id = body_or_request_id if isinstance(body_or_request_id, str) else request_id_of(body_or_request_id)
        chunks = self.chunks(request_id)
        assert [c.seq for c in chunks] == list(range(len(chunks))), [c.seq for c in chunks]
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        return [token for c in chunks for token in c.token_ids]
