"""The remote-or-local prefill decision is one pure function."""

import pytest

from services.scheduler.routing import MIN_OFFLOADED_PREFILL, decide_prefill


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
