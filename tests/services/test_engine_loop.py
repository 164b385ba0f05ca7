"""The engine loop on a real engine: a burst of requests reaching an idle engine starts in one step."""

import threading
import time

import pytest

import services.common.engine_loop as engine_loop
from services.common.engine_loop import AddRequest, EngineLoop
from services.common.engine_thread import EngineThread
from shared.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine_and_thread(default_model):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    thread = EngineThread()
    return thread.submit(LLMEngine, EngineConfig(model=default_model, max_num_seqs=4)).result(120), thread


def _first_step_of_a_burst(engine_and_thread, gather_s: float) -> set[str]:
    """Request a, then b 0.1 s later, to an idle engine: which of them its first step computed."""
    engine, thread = engine_and_thread
    steps: list[set[str]] = []
    emitted = threading.Event()

    def emit(outputs):
        if outputs:
            steps.append({o.request_id for o in outputs})
            emitted.set()

    loop = EngineLoop(engine, emit, thread, gather_s=gather_s)
    loop.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        loop.add(AddRequest("a", list(range(5, 30)), params))
        time.sleep(0.1)
        loop.add(AddRequest("b", list(range(7, 40)), params))
        assert emitted.wait(30)
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert loop.crashed is None
    return steps[0]


def test_an_idle_engine_takes_a_burst_into_its_first_step(engine_and_thread, monkeypatch):
    monkeypatch.setattr(engine_loop, "GATHER_QUIET_S", 0.5)  # b comes 0.1 s after a: well inside
    assert _first_step_of_a_burst(engine_and_thread, gather_s=2.0) == {"a", "b"}


def test_without_a_window_the_first_step_starts_at_once(engine_and_thread):
    assert _first_step_of_a_burst(engine_and_thread, gather_s=0.0) == {"a"}


def test_a_negative_window_is_refused(engine_and_thread):
    engine, thread = engine_and_thread
    with pytest.raises(ValueError, match="gather_s"):
        EngineLoop(engine, lambda outputs: None, thread, gather_s=-1)
