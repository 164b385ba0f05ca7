"""The gateway's guard, as plain ASGI: every HTTP request gets an id and its tenant (from its API key) in its state;
a guarded path without a key the gateway knows is answered 401; every answer, a 401 too, carries `x-request-id`
(and `x-trace-id` where the request was traced).

Plain ASGI rather than `@app.middleware("http")`: Starlette's `BaseHTTPMiddleware` passes every chunk of a
streamed answer through a memory stream of its own, which, with two of them, was a tenth of the gateway's CPU
time at a few hundred open streams (py-spy, bench_tenants' noisy phase).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.tenant_keys import DEFAULT_TENANT
from services.gateway.edge import unauthorized
from services.gateway.tenants import TenantDirectory


class Guard:
    def __init__(self, app: ASGIApp, *, tenants: TenantDirectory, guarded: Callable[[str], bool]) -> None:
        """`guarded(path)`: whether the path needs an API key (when the gateway has keys)."""
        self.app, self.tenants, self.guarded = app, tenants, guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"], state["trace_id"] = uuid.uuid4().hex, ""

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = state["request_id"]
                if state.get("trace_id"):
                    headers["x-trace-id"] = state["trace_id"]
            await send(message)

        tenant = self.tenants.tenant_for(Headers(scope=scope).get("authorization"))
        if tenant is None and self.guarded(scope["path"]):
            await unauthorized().response()(scope, receive, send_with_ids)
            return
        state["tenant"] = tenant or DEFAULT_TENANT
        await self.app(scope, receive, send_with_ids)
