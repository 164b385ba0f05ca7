"""A streamed completion as the tests read it: every SSE data object, in order."""

import json

import httpx


def stream(base_url: str, body: dict, on_chunk=lambda chunks: None, timeout_s: float = 120,
           api_key: str | None = None) -> list[dict]:
    """Every SSE data object of a streamed completion, `on_chunk` called with them as each arrives."""
    events = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=timeout_s) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
                on_chunk(events)
    return events


def streamed_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])
