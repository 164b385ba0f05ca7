"""The gateway's side of a request's life on the bus: submit, follow, cancel."""

from collections.abc import AsyncIterator

from contracts import Assignment, CancelRequest, GenerateRequest, Sampling, Subjects, TokenChunk
from services.common.identity import now_ms
from services.gateway.streams import RequestStream, StreamError, TokenStreams
from shared.telemetry.logging import get_logger

log = get_logger(__name__)


class RequestBus:
    def __init__(self, *, nc, subjects: Subjects, gateway_id: str, streams: TokenStreams,
                 assign_timeout_s: float = 30.0, idle_timeout_s: float = 300.0):
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.gateway_id = gateway_id
        self.streams = streams
        self.assign_timeout_s = assign_timeout_s
        self.idle_timeout_s = idle_timeout_s

    async def submit(self, request_id: str, model: str, prompt_token_ids: list[int], sampling: Sampling,
                     headers: dict[str, str] | None = None) -> RequestStream:
        """Queue the request for the scheduler (with `headers`, e.g. its trace context) and wait until a
        worker owns it.

        Raises StreamError (e.g. "no_worker") when it cannot start; nothing is
        left behind in that case.
        """
        stream = self.streams.open(request_id)
        created_ms = now_ms()
        request = GenerateRequest(
            request_id=request_id,
            model=model,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            reply_subject=self.subjects.tokens(self.gateway_id, request_id),
            deadline_ms=created_ms + int(self.assign_timeout_s * 1000),
            created_ms=created_ms,
        )
        try:
            try:
                # Nats-Msg-Id lets JetStream drop a re-sent duplicate of the same request.
                await self.js.publish(self.subjects.submit, request.encode(), timeout=5.0,
                                      headers={**(headers or {}), "Nats-Msg-Id": request_id})
            except Exception as exc:  # NATS down, no stream, publish timeout
                log.warning("submit failed", request_id=request_id, error=repr(exc))
                raise StreamError("no_worker", "the request queue is unavailable", retry_after_s=1.0) from exc
            event = await stream.next_event(self.assign_timeout_s)
            if not isinstance(event, Assignment):
                raise StreamError("internal", "the worker streamed tokens before taking the request")
        except BaseException:
            # Timed out, failed or the client left: make sure no worker keeps it.
            await self.release(stream)
            raise
        return stream

    async def chunks(self, stream: RequestStream) -> AsyncIterator[TokenChunk]:
        """The request's token chunks in order, until the finished one."""
        while not stream.finished:
            event = await stream.next_event(self.idle_timeout_s)
            if isinstance(event, TokenChunk):
                yield event

    async def release(self, stream: RequestStream) -> None:
        """Forget the request; if it is still running anywhere, cancel it there."""
        self.streams.close(stream.request_id)
        if not stream.finished:
            cancel = CancelRequest(request_id=stream.request_id, reason="client_disconnected")
            try:
                await self.nc.publish(self.subjects.cancel, cancel.encode())
            except Exception as exc:
                log.warning("cancel publish failed", request_id=stream.request_id, error=repr(exc))

