"""The remote-or-local prefill decision is one pure function."""

import pytest

from services.scheduler.worker_choice import MIN_OFFLOADED_PREFILL, decide_prefill, prefill_backlog


@pytest.mark.parametrize("tokens,queue,threshold,max_queue,workers,expected", [  # the decode worker idle
    (1000, 0, 256, 64, 1, "remote"),    # long prompt, idle pool
    (100, 0, 256, 64, 1, "local"),      # short prompt
    (256, 0, 256, 64, 1, "local"),      # exactly the threshold stays local
    (257, 0, 256, 64, 1, "remote"),
    (1, 0, 0, 64, 1, "remote"),         # 0: always remote
    (1000, 64, 256, 64, 1, "local"),    # queue full
    (1000, 63, 256, 64, 1, "remote"),
    (1000, 0, 0, 64, 0, "local"),       # no prefill workers at all
])
def test_decide_prefill(tokens, queue, threshold, max_queue, workers, expected):
    assert decide_prefill(tokens, queue, max_local_prefill=threshold, max_prefill_queue=max_queue,
                          prefill_workers_ready=workers) == expected


@pytest.mark.parametrize("tokens,queue,workers,offload,expected", [
    (128, 0, 1, True, "remote"),       # short prompt, busy decode worker, idle prefill worker
    (128, 1, 1, True, "local"),        # the one prefill worker has a job: a short prompt would wait behind it
    (128, 1, 2, True, "remote"),       # two prefill workers, one job: one is idle
    (128, 0, 1, False, "local"),       # offloading short prompts turned off
    (MIN_OFFLOADED_PREFILL - 1, 0, 1, True, "local"),  # too short to be worth shipping
    (MIN_OFFLOADED_PREFILL, 0, 1, True, "remote"),
    (128, 0, 0, True, "local"),        # no prefill pool
    (1000, 5, 1, True, "remote"),      # long prompts queue as before
])
def test_short_prompts_go_to_an_idle_prefill_pool_when_the_decode_worker_is_busy(tokens, queue, workers, offload,
                                                                                  expected):
    assert decide_prefill(tokens, queue, max_local_prefill=256, max_prefill_queue=64, prefill_workers_ready=workers,
                          decode_worker_busy=True, offload_short=offload) == expected


@pytest.mark.parametrize("tokens,backlog,workers,factor,threshold,expected", [
    (1600, 1600, 1, 0.5, 256, "local"),    # one worker busy with a prompt as long: computing it here starts at once
    (1600, 800, 1, 0.5, 256, "remote"),    # exactly the factor's share queued still goes
    (1600, 801, 1, 0.5, 256, "local"),
    (1600, 1600, 2, 0.5, 256, "remote"),   # two workers share the backlog: 800 each
    (1600, 0, 1, 0.5, 256, "remote"),      # an idle pool
    (1600, 10_000, 1, 0.0, 256, "remote"),  # 0: the backlog never keeps a prompt local
    (1600, 10_000, 1, 0.5, 0, "remote"),   # --max-local-prefill 0: every prompt remote, whatever the backlog
    (300, 1600, 1, 0.5, 256, "local"),     # a prompt just over the threshold behind a long one
])
def test_a_long_prompt_stays_local_behind_a_deep_prefill_backlog(tokens, backlog, workers, factor, threshold,
                                                                  expected):
    assert decide_prefill(tokens, 1, max_local_prefill=threshold, max_prefill_queue=64, prefill_workers_ready=workers,
                          decode_worker_busy=True, prefill_backlog_tokens=backlog, backlog_factor=factor) == expected


@pytest.mark.parametrize("routed,depth,expected", [
    ([], 3, 0),                  # nothing known
    ([100, 200, 300], 0, 0),     # the queue is empty: everything sent has been computed
    ([100, 200, 300], 2, 500),   # first in, first out: the newest two are still queued
    ([100, 200, 300], 5, 600),   # deeper than this scheduler knows (other schedulers' jobs): what it knows
])
def test_the_prefill_backlog_is_the_newest_jobs_still_queued(routed, depth, expected):
    assert prefill_backlog(routed, depth) == expected
