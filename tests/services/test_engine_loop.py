"""The engine loop on a real engine: a burst of requests reaching an idle engine starts in one step."""

import threading
import time

import pytest

import services.common.engine_loop as engine_loop
from services.common.engine_loop import AddRequest, EngineLoop
from services.common.engine_thread import EngineThread
from shared.engine.sampling_params import SamplingParams
from support.waiting import wait_until


@pytest.fixture(scope="module")
def engine_and_thread(default_model):
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    thread = EngineThread()
    return thread.submit(LLMEngine, EngineConfig(model=default_model, max_num_seqs=4)).result(120), thread


def _first_step_of_a_burst(engine_and_thread, gather_s: float, then_b) -> set[str]:
    """Request a, then b once `then_b()` returns, to an idle engine: which of them its first step computed."""
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
        then_b()
        loop.add(AddRequest("b", list(range(7, 40)), params))
        assert emitted.wait(30), "no step's outputs"
        wait_until(lambda: not engine.has_unfinished_requests(), 30, "a and b did not finish", poll_s=0.01)
    finally:
        loop.stop()
    assert loop.crashed is None
    return steps[0]


def test_an_idle_engine_takes_a_burst_into_its_first_step(engine_and_thread, monkeypatch):
    monkeypatch.setattr(engine_loop, "GATHER_QUIET_S", 0.5)
    # The gap is the input: b comes 0.1 s after a, when a lone a would have been stepped, well inside the window.
    assert _first_step_of_a_burst(engine_and_thread, gather_s=2.0, then_b=lambda: time.sleep(0.1)) == {"a", "b"}


def test_without_a_window_the_first_step_starts_at_once(engine_and_thread, monkeypatch):
    monkeypatch.setattr(engine_loop, "GATHER_QUIET_S", 2.0)  # what a loop gathering anyway would wait for
    engine, _ = engine_and_thread
    stepping = threading.Event()
    step = engine.step

    def step_and_tell():
        stepping.set()
        return step()

    monkeypatch.setattr(engine, "step", step_and_tell)

    def once_a_is_stepping():  # (the time is the claim: at once, not after a quiet window; 1.5 s is loose for that)
        assert stepping.wait(1.5), "a's first step did not start at once"

    assert _first_step_of_a_burst(engine_and_thread, gather_s=0.0, then_b=once_a_is_stepping) == {"a"}


def test_a_negative_window_is_refused(engine_and_thread):
    engine, thread = engine_and_thread
    with pytest.raises(ValueError, match="gather_s"):
        EngineLoop(engine, lambda outputs: None, thread, gather_s=-1)


def test_every_step_is_measured_by_kind(engine_and_thread):
    """A prompt's steps count as prompt steps with its computed tokens; the steps after, as decode steps, each
    with the sequences it gave a token."""
    engine, thread = engine_and_thread
    loop = EngineLoop(engine, lambda outputs: None, thread)
    loop.start()
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        computed = engine.num_prompt_tokens_computed
        loop.add(AddRequest("m1", list(range(300, 340)), params))
        loop.add(AddRequest("m2", list(range(400, 440)), params))
        wait_until(lambda: loop.steps.decode.steps and not engine.has_unfinished_requests(), 30,
                   "m1 and m2 did not finish", poll_s=0.01)
    finally:
        loop.stop()
    steps = loop.steps.details()
    assert steps["prompt"]["prompt_tokens"] == engine.num_prompt_tokens_computed - computed > 0
    assert steps["prompt"]["steps"] >= 1 and steps["prompt"]["seconds"] > 0
    decode = steps["decode"]
    assert decode["prompt_tokens"] == 0 and decode["seconds"] > 0
    assert decode["steps"] <= decode["sequences"] <= 2 * decode["steps"]  # 1 or 2 sequences a step
    assert steps["prompt"]["sequences"] + decode["sequences"] == 2 * 5  # every token of both
