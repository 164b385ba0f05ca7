"""A handoff refused as routed under an old role epoch ("stale_role"): the scheduler offers the request to the next
worker (and waits for a fresh view where none is left), never failing it for that; each offer carries the epoch of
the worker it goes to."""

import asyncio
from types import SimpleNamespace

from contracts import GenerateRequest, HandoffReply, ServiceInfo
from services.scheduler.request_loop import Router
from shared.engine import SamplingParams


def _worker(name: str, epoch: int, running: int) -> ServiceInfo:
    return ServiceInfo(instance_id=name, role="decode", served_model_name="m", state="ready", boot_id=name,
                       max_num_seqs=8, num_running=running, kv_blocks_total=10, kv_blocks_free=10, role_epoch=epoch)


def test_a_stale_handoff_goes_to_the_next_worker():
    async def scenario():
        async def publish(subject, data):
            pass

        router = Router(nc=SimpleNamespace(is_connected=True, publish=publish),
                        registry=SimpleNamespace(ttl_s=6.0), subjects=None, instance_id="scheduler-0",
                        handoff_timeout_s=1.0, max_local_prefill=10_000, max_prefill_queue=8,
                        offload_short_prefills=False, prefill_backlog_factor=0.0, router="load", overlap_weight=2.0,
                        max_index_blocks=100)
        # decode-0 (less loaded, so offered first) switched to prefill and back since this view: epoch 2 now.
        router.workers = [_worker("decode-0", 0, 0), _worker("decode-1", 3, 1)]
        offers, told = [], []

        async def offer(worker, request):
            offers.append((worker.instance_id, request.role_epoch))
            if worker.instance_id == "decode-0":  # what its DecodeRole._admit answers
                return HandoffReply(request_id=request.request_id, accepted=False, code="stale_role",
                                    message="routed under role epoch 0; this worker is at epoch 2")
            return HandoffReply(request_id=request.request_id, accepted=True, handoffs_taken=1)

        async def tell_gateway(request, event):
            told.append(event)

        router._offer, router._tell_gateway = offer, tell_gateway
        request = GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(),
                                  reply_subject="ns.tokens.g.r1", deadline_ms=2**62, created_ms=0)
        outcome = await router._offer_to_workers(request, SimpleNamespace(lapsed=lambda: False))
        return outcome, offers, told, router.stale_refusals

    outcome, offers, told, stale = asyncio.run(scenario())
    assert outcome == ("assigned", False)
    assert offers == [("decode-0", 0), ("decode-1", 3)]
    assert [type(e).__name__ for e in told] == ["Assignment"] and told[0].worker_instance == "decode-1"
    assert stale == 1
