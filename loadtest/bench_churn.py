"""Pool changes under load: N role switches and scales of a running deployment while greedy streams run, and
what they cost (issue 37's target: 50 changes lose 0 requests and duplicate 0 tokens; each drain ends within the
longest remaining generation + 2 s).

One `splitserve up` deployment (`--up-args`; by default disagg, 1 prefill + 2 decode workers, `--role-switch`)
first serves every prompt once with nothing happening: the reference texts. Then waves of `--streams` concurrent
greedy streams run without pause while the control API (the launcher's socket, as `splitserve switch` and
`splitserve scale` use it) makes `--changes` changes one after another, each once the one before has settled:
a switch of the newest decode worker to prefill and back (in place, on its loaded model), and, every
`--scale-every`th change, a scale of the decode pool up by one and back down (a new process; a removed one
drains). Per change: its kind, how long it took, and for a switch the worker's drain time against the longest
time any stream then in flight still ran (the bound the drain must keep within, + 2 s). Over all streams: lost
(ended with an error or cut short), and identical to the reference (a duplicated or dropped token shows here).

    python -m loadtest.bench_churn --model smollm2-135m-instruct --changes 50 \\
        --out loadtest/results/churn.json --table loadtest/results/churn.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from pathlib import Path

import httpx

from services.bench.up_process import UpProcess, serving
from services.launcher.control_client import call

DRAIN_SLACK_S = 2.0
SETTLE_TIMEOUT_S = 300.0


async def one_stream(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, started: float) -> dict:
    """One greedy stream sent at `started`: its text, when it ended, and the error it ended with (None: none)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    pieces, error = [], None
    try:
        async with client.stream("POST", f"{base}/completions", json=body, timeout=300) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        error = event["error"].get("code") or "error"
                        break
                    if event["choices"]:
                        pieces.append(event["choices"][0]["text"])
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    return {"prompt": prompt, "text": "".join(pieces), "started": started, "ended": time.monotonic(),
            "error": error}


async def waves(base: str, prompts: list[str], max_tokens: int, stop: asyncio.Event, done: list[dict],
                flying: dict[int, float]) -> None:
    """Each stream is followed at once by the next prompt's, `len(prompts)` in flight, until `stop`; `flying[lane]`
    is when the lane's stream in flight started."""
    async with httpx.AsyncClient() as client:
        async def lane(i: int) -> None:
            k = i
            while not stop.is_set():
                flying[i] = time.monotonic()
                done.append(await one_stream(client, base, prompts[k % len(prompts)], max_tokens, flying[i]))
                k += len(prompts)

        await asyncio.gather(*(lane(i) for i in range(len(prompts))))


def control(deployment: UpProcess, method: str, route: str, body=None, timeout_s: float = SETTLE_TIMEOUT_S):
    socket = json.loads((deployment.run_dir / "deployment.json").read_text())["control_socket"]
    return call(socket, method, route, body, timeout_s=timeout_s)


def wait_settled(deployment: UpProcess) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        status, view = control(deployment, "GET", "/v1/deployment")
        if status == 200 and view.get("settled"):
            return
        time.sleep(0.25)
    raise RuntimeError("the deployment did not settle")


def plan(changes: int, scale_every: int, decode: int) -> list[tuple[str, dict]]:
    """The changes in order: switch decode-1 to prefill and back, and every `scale_every`th change a decode scale
    up or back down."""
    steps, switched, scaled = [], False, False
    for i in range(changes):
        if scale_every and (i + 1) % scale_every == 0 and not switched:
            scaled = not scaled
            steps.append(("/v1/scale", {"decode": decode + 1 if scaled else decode}))
        else:
            switched = not switched
            steps.append(("/v1/switch", {"instance": "decode-1", "to": "prefill" if switched else "decode"}))
    return steps


def make_changes(deployment: UpProcess, steps: list[tuple[str, dict]], done: list[dict],
                 in_flight) -> list[dict]:
    records = []
    for route, body in steps:
        wait_settled(deployment)
        began = time.monotonic()
        flying = in_flight()
        status, answer = control(deployment, "POST", route, body)
        record = {"route": route, "body": body, "status": status, "seconds": round(time.monotonic() - began, 3),
                  "error": answer.get("error")}
        if route == "/v1/switch" and status == 200:
            record.update(drain_s=answer["drain_s"], switch_s=answer["switch_s"], flying=flying, began=began)
        records.append(record)
        print(f"   {route} {body}: {status} in {record['seconds']} s {answer.get('error') or ''}", flush=True)
    wait_settled(deployment)
    for record in records:  # the longest a stream in flight at the switch then still ran
        if "flying" in record:
            flying, began = record.pop("flying"), record.pop("began")
            ends = [s["ended"] for s in list(done) if s["started"] in flying]
            record["longest_remaining_s"] = round(max((end - began for end in ends), default=0.0), 3)
    return records


async def measure(deployment: UpProcess, args, prompts: list[str]) -> dict:
    base = deployment.base_url
    async with httpx.AsyncClient() as client:
        reference = {p: (await one_stream(client, base, p, args.max_tokens, time.monotonic()))["text"]
                     for p in prompts}
    done: list[dict] = []
    flying: dict[int, float] = {}
    stop = asyncio.Event()

    def in_flight() -> set[float]:  # the streams started and not ended yet, by when they started
        ended = {s["started"] for s in list(done)}
        return {t for t in dict(flying).values() if t not in ended}

    load = asyncio.create_task(waves(base, prompts, args.max_tokens, stop, done, flying))
    steps = plan(args.changes, args.scale_every, args.decode)
    try:
        records = await asyncio.to_thread(make_changes, deployment, steps, done, in_flight)
    finally:
        stop.set()
        await load
    lost = [s for s in done if s["error"]]
    differ = [s for s in done if not s["error"] and s["text"] != reference[s["prompt"]]]
    switches = [r for r in records if "drain_s" in r]
    over = [r for r in switches if r["drain_s"] > r["longest_remaining_s"] + DRAIN_SLACK_S]
    return {"changes": records, "streams": len(done), "lost": len(lost), "errors": sorted({s["error"] for s in lost}),
            "differ_from_reference": len(differ), "refused_changes": sum(r["status"] != 200 for r in records),
            "switches": len(switches), "drains_over_bound": len(over),
            "drain_s_max": max((r["drain_s"] for r in switches), default=None),
            "switch_s_max": max((r["switch_s"] for r in switches), default=None),
            "switch_s_median": sorted(r["switch_s"] for r in switches)[len(switches) // 2] if switches else None}


def table(result: dict, args) -> str:
    return "\n".join([
        "| changes (switches + scales) | refused | streams | lost | differ from the undisturbed run | "
        "drains over the bound | switch time p50 / max | drain max |",
        "|---|---|---|---|---|---|---|---|",
        f"| {len(result['changes'])} ({result['switches']} + {len(result['changes']) - result['switches']}) | "
        f"{result['refused_changes']} | {result['streams']} | {result['lost']} | {result['differ_from_reference']} | "
        f"{result['drains_over_bound']} | {result['switch_s_median']} / {result['switch_s_max']} s | "
        f"{result['drain_s_max']} s |"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, directory or .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--decode", type=int, default=2, help="decode workers at the start (decode-1 switches)")
    parser.add_argument("--up-args", default="--topology disagg --prefill 1 --role-switch",
                        help="the deployment's other `splitserve up` flags")
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--scale-every", type=int, default=5, help="every Nth change is a decode scale (0: none)")
    parser.add_argument("--streams", type=int, default=4, help="streams in flight all along")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", help="the figures (JSON)")
    parser.add_argument("--table", help="the markdown table")
    args = parser.parse_args(argv)
    from shared.engine.model_registry import resolve_model

    model_dir = str(resolve_model(args.model).model_dir)
    prompts = [f"Story {i}: once upon a time in a town by the sea, there lived" for i in range(args.streams)]
    with tempfile.TemporaryDirectory(prefix="splitserve-churn-") as tmp:
        with serving("churn", [*shlex.split(args.up_args), "--decode", str(args.decode)], model_dir=model_dir,
                     run_dir=Path(tmp) / "run", dtype=args.dtype) as deployment:
            result = asyncio.run(measure(deployment, args, prompts))
    rendered = table(result, args)
    print(rendered)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), **result}, indent=2))
    if args.table:
        Path(args.table).write_text(rendered + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
