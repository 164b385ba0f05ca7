"""The gateway's one-stop view of the deployment: every service's stats, asked for over the bus when /metrics is
scraped, so the view is as of the scrape (not of the last heartbeat) and reaches services on any host."""

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import nats.errors

from contracts import ContractError, ServiceInfo, ServiceStats, StatsRequest, Subjects
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

STATS_TIMEOUT_S = 2.0  # well inside Prometheus' default 10 s scrape timeout; the requests go out side by side


@dataclass(frozen=True)
class ScrapedStats:
    answered: list[ServiceStats]
    silent: list[ServiceInfo]  # in the registry, but no stats came back in time (frozen, gone, or overloaded)


async def ask_every_service(nc, subjects: Subjects, entries: list[ServiceInfo],
                            timeout_s: float = STATS_TIMEOUT_S) -> ScrapedStats:
    """Ask each entry's service for its stats at once; each reply must come from the instance asked."""
    async def ask(entry: ServiceInfo) -> ServiceStats | None:
        try:
            reply = await nc.request(subjects.stats(entry.instance_id), StatsRequest().encode(), timeout=timeout_s)
            stats = ServiceStats.decode(reply.data)
        except (asyncio.TimeoutError, nats.errors.Error, ContractError) as exc:
            log.info("no stats from a service", instance=entry.instance_id, error=repr(exc))
            return None
        if stats.instance_id != entry.instance_id:
            log.warning("stats answered by another instance than asked", asked=entry.instance_id,
                        answered=stats.instance_id)
            return None
        return stats

    results = await asyncio.gather(*(ask(entry) for entry in entries))
    return ScrapedStats(answered=[stats for stats in results if stats is not None],
                        silent=[entry for entry, stats in zip(entries, results) if stats is None])


def labelled(scraped: ScrapedStats, model_name: str) -> ScrapedStats:
    """`scraped` with every entry's `served_model_name` the model whose namespace it was asked in: what labels its
    series (a scheduler's and a kv-store's too; two models' pools may each have a `decode-0`)."""
    def named(entries):
        return [msgspec.structs.replace(entry, served_model_name=model_name) for entry in entries]

    return ScrapedStats(answered=named(scraped.answered), silent=named(scraped.silent))


def merged(scrapes: Iterable[ScrapedStats]) -> ScrapedStats:
    scrapes = list(scrapes)
    return ScrapedStats(answered=[entry for s in scrapes for entry in s.answered],
                        silent=[entry for s in scrapes for entry in s.silent])
