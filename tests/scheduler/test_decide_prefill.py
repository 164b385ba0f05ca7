"""The remote-or-local prefill decision is one pure function."""

import pytest

from services.scheduler.routing import decide_prefill


@pytest.mark.parametrize("tokens,queue,threshold,max_queue,workers,expected", [
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
