"""What the gateway's one-stop /metrics costs: each scrape asks every service of the registry for its stats over
NATS (concurrent scrapes share one round), so a scrape's time and its effect on serving are worth knowing.

One `splitserve up` deployment (`--up-args`, by default disagg with a kv-store: four services answer the
gateway) is measured three ways:

- idle: `--scrapes` scrapes one after another: latency, body size, series;
- crowded: `--scrapers` clients scraping at once, `--scrapes` rounds: each client's latency;
- under load: `--streams` greedy streams of `--max-tokens` tokens, with nobody scraping, then with a scrape every
  `--interval-s` (Prometheus scrapes every 15 s by default; this is far more often), then with nobody scraping
  again (the run-to-run spread): the streams' inter-token latency each time, and the scrapes' latency.

    python -m loadtest.bench_scrape --out loadtest/results/scrape.json --table loadtest/results/scrape.md
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
import numpy as np

from loadtest.bench_faults import run_streams
from services.bench.up_process import serving


def _percentiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50": None, "p95": None, "max": None, "n": 0}
    values = np.array(seconds) * 1000
    return {"p50": round(float(np.percentile(values, 50)), 1), "p95": round(float(np.percentile(values, 95)), 1),
            "max": round(float(values.max()), 1), "n": len(seconds)}


async def scrape(client: httpx.AsyncClient, url: str) -> tuple[float, str]:
    started = time.monotonic()
    response = await client.get(url, timeout=30)
    response.raise_for_status()
    return time.monotonic() - started, response.text


async def idle(url: str, scrapes: int) -> dict:
    async with httpx.AsyncClient() as client:
        await scrape(client, url)  # the first builds the collectors
        timed = [await scrape(client, url) for _ in range(scrapes)]
    body = timed[-1][1]
    series = [line for line in body.splitlines() if line and not line.startswith("#")]
    return {"latency_ms": _percentiles_ms([t for t, _ in timed]), "body_bytes": len(body.encode()),
            "series": len(series),
            "services_up": sum(1 for s in series if s.startswith("splitserve_service_up") and s.endswith(" 1.0")),
            "services_down": sum(1 for s in series if s.startswith("splitserve_service_up") and s.endswith(" 0.0"))}


async def crowded(url: str, scrapers: int, rounds: int) -> dict:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=scrapers)) as client:
        times: list[float] = []
        for _ in range(rounds):
            times += [t for t, _ in await asyncio.gather(*(scrape(client, url) for _ in range(scrapers)))]
    return {"latency_ms": _percentiles_ms(times)}


def _itl(streams: list[dict]) -> dict:
    gaps = [b - a for s in streams for a, b in zip(s["times"], s["times"][1:])]
    return {**_percentiles_ms(gaps), "lost": sum(1 for s in streams if s["error"])}


async def under_load(base: str, url: str, prompts: list[str], max_tokens: int, interval_s: float) -> dict:
    quiet = await run_streams(base, prompts, max_tokens)
    scraped: list[float] = []
    done = asyncio.Event()

    async def scraper():
        async with httpx.AsyncClient() as client:
            while not done.is_set():
                started = time.monotonic()
                scraped.append((await scrape(client, url))[0])
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    task = asyncio.create_task(scraper())
    try:
        busy = await run_streams(base, prompts, max_tokens)
    finally:
        done.set()
        await task
    quiet_again = await run_streams(base, prompts, max_tokens)  # the run-to-run spread, beside the difference
    texts_match = sum(a["text"] == b["text"] == c["text"] for a, b, c in zip(quiet, busy, quiet_again))
    return {"itl_ms_no_scrapes": _itl(quiet), "itl_ms_scraped": _itl(busy), "itl_ms_no_scrapes_again": _itl(quiet_again),
            "scrape_latency_ms": _percentiles_ms(scraped), "texts_identical": texts_match, "streams": len(prompts)}


async def measure(base: str, args) -> dict:
    url = base.removesuffix("/v1") + "/metrics"
    prompts = [f"Report {i}: the harbour master counted the boats and wrote" for i in range(args.streams)]
    return {"idle": await idle(url, args.scrapes), "crowded": await crowded(url, args.scrapers, args.scrapes),
            "under_load": await under_load(base, url, prompts, args.max_tokens, args.interval_s)}


def table(result: dict, args) -> str:
    idle_, crowd, load = result["idle"], result["crowded"], result["under_load"]

    def lat(d: dict) -> str:
        return f"{d['p50']} / {d['p95']} / {d['max']} ms"

    rows = [
        ("one scrape at a time, p50 / p95 / max", lat(idle_["latency_ms"])),
        ("its body", f"{idle_['body_bytes']:,} bytes, {idle_['series']:,} series, "
                     f"{idle_['services_up']} services up"),
        (f"{args.scrapers} scrapers at once, p50 / p95 / max", lat(crowd["latency_ms"])),
        (f"{args.streams} streams: ITL p50 / p95 / max, nobody scraping", lat(load["itl_ms_no_scrapes"])),
        (f"same, a scrape every {args.interval_s:g} s", lat(load["itl_ms_scraped"])),
        ("same, nobody scraping again", lat(load["itl_ms_no_scrapes_again"])),
        ("the scrapes meanwhile, p50 / p95 / max", lat(load["scrape_latency_ms"])),
        ("streams identical in the three runs (greedy)", f"{load['texts_identical']}/{load['streams']}"),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name, directory or .gguf")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--up-args", default="--topology disagg --kv-store", help="the deployment's `up` flags")
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--scrapers", type=int, default=8)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--out", help="the figures (JSON)")
    parser.add_argument("--table", help="the markdown table")
    args = parser.parse_args(argv)
    if min(args.scrapes, args.scrapers, args.streams, args.max_tokens) < 1 or args.interval_s <= 0:
        parser.error("--scrapes, --scrapers, --streams and --max-tokens are at least 1, --interval-s above 0")
    from shared.engine.model_registry import resolve_model

    model_dir = str(resolve_model(args.model).model_dir)
    with tempfile.TemporaryDirectory(prefix="splitserve-scrape-") as tmp:
        with serving("scrape", shlex.split(args.up_args), model_dir=model_dir, run_dir=Path(tmp) / "run",
                     dtype=args.dtype) as deployment:
            result = asyncio.run(measure(deployment.base_url, args))
    rendered = table(result, args)
    print(rendered)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), **result}, indent=2))
    if args.table:
        Path(args.table).write_text(rendered + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
