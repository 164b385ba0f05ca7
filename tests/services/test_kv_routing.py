"""KV-aware routing: requests go to the worker (decode or prefill) whose cache holds their prompt's prefix."""

import pytest
from transformers import AutoTokenizer

from support.deployment import start_deployment
from support.kv_workload import conversation, run_conversation, wait_until
from support.waiting import eventually


@pytest.mark.timeout(300)
def test_kv_routing_sends_a_conversation_to_the_worker_holding_it(nats_server, default_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    requests = conversation(default_model)
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=2,
                                  scheduler_args=("--router", "kv"))

    def indexed(i):
        """Before the next request, the scheduler has heard (KV events) what the worker holds, and (load reports)
        that the previous turn ended: a turn it still counted as running would weigh against its holder."""
        need = [0, 25, 25][i]

        def settled():
            details = deployment.stats("scheduler-0").details
            loads = details["loads_seen"].values()
            return (details["prefix_index"]["blocks"] >= need and not any(details["routed_unconfirmed"].values())
                    and all(load["requests"] == 0 for load in loads))
        wait_until(settled, 15, "the scheduler never saw the previous turn indexed and ended")

    try:
        cached = run_conversation(deployment, requests, tokenizer, indexed)
        assert cached == [0, 400, 320]  # all from the worker's own cache: no kv-store here
        stats = {w: deployment.stats(w).details["prefix_cache"] for w in ("decode-0", "decode-1")}
        holder = next(w for w, s in stats.items() if s["prompt_tokens_computed"])
        other = "decode-1" if holder == "decode-0" else "decode-0"
        assert stats[holder]["hit_tokens"]["local"] == 720 and stats[other]["prompt_tokens_computed"] == 0
        scheduler = deployment.stats("scheduler-0").details
        assert scheduler["router"] == "kv" and scheduler["prefix_hits"]["cached_blocks"] == 25 + 20
    finally:
        deployment.stop()


@pytest.mark.timeout(300)
def test_a_prefill_job_goes_to_the_prefill_worker_holding_its_prefix(nats_server, default_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    first, _, sharing = conversation(default_model)
    # No kv-store: a cached prefix in the prefill pool can only come from the prefill worker that computed it.
    deployment = start_deployment(nats_server.url, tmp_path, default_model, workers=1, prefill=2,
                                  scheduler_args=("--max-local-prefill", "0"))

    def indexed(i):  # the scheduler has heard which prefill worker holds the first prompt's blocks
        if i:
            wait_until(lambda: any(n >= 24 for instance, n in deployment.stats("scheduler-0").details[
                "prefix_index"]["by_instance"].items() if instance.startswith("prefill-")), 15,
                "the scheduler's prefix index did not get the prefill worker's blocks")

    try:
        assert run_conversation(deployment, [first, sharing], tokenizer, indexed) == [0, 320]
        decode = deployment.stats("decode-0").details
        assert decode["prefill_decisions"].get("offered") == 1 and decode["prefill_decisions"].get("remote") == 2
        computed = sorted(deployment.stats(p).details["prefix_cache"]["prompt_tokens_computed"]
                          for p in ("prefill-0", "prefill-1"))
        assert computed == [0, len(first[0]) + len(sharing[0]) - 320]  # one worker did both, the second from cache
    finally:
        deployment.stop()


class Watched:
    """A registry, its reads of one entry counted (each once answered)."""

    def __init__(self, registry):
        self.registry = registry
        self.reads = 0

    async def get(self, role: str, instance_id: str):
        entry = await self.registry.get(role, instance_id)
        self.reads += 1
        return entry


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_job_offered_to_a_prefill_worker_that_leaves_is_given_up_at_once(nats_server):
    # Nothing redelivers a job offered straight to a worker: the decode worker watches the registry instead of
    # waiting out its prefill deadline.
    import asyncio
    import uuid

    import nats

    from contracts import ServiceInfo, Subjects
    from services.decode.remote_prefill import _result_unless_gone
    from shared.bus.registry import Registry

    nc = await nats.connect(nats_server.url)
    try:
        registry = await Registry.open(nc.jetstream(), Subjects("t" + uuid.uuid4().hex[:8]).registry_bucket)
        await registry.put(ServiceInfo(instance_id="prefill-7", role="prefill", boot_id="boot-1", state="ready"))
        watched = Watched(registry)
        waiting = asyncio.create_task(_result_unless_gone(watched, asyncio.get_running_loop().create_future(),
                                                          "prefill-7"))
        # It looked twice and found the same worker both times (the second read compares boot ids).
        await eventually(lambda: watched.reads >= 2, 10, "the registry read twice")
        assert not waiting.done()  # still there: keep waiting
        await registry.put(ServiceInfo(instance_id="prefill-7", role="prefill", boot_id="boot-2", state="ready"))
        assert await asyncio.wait_for(waiting, 5) is None  # restarted: the job died with the old process

        answered = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(_result_unless_gone(registry, answered, "prefill-7"))
        answered.set_result("result")
        assert await asyncio.wait_for(waiting, 5) == "result"
        waiting = asyncio.create_task(_result_unless_gone(registry, asyncio.get_running_loop().create_future(),
                                                          "prefill-7"))
        await registry.remove("prefill", "prefill-7")
        assert await asyncio.wait_for(waiting, 5) is None  # gone
    finally:
        await nc.close()
