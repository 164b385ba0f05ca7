"""The engine's loop: the one place that touches the LLMEngine, on the worker's `EngineThread`.

The asyncio side (NATS I/O) sends it commands; the loop applies them between
steps, runs `engine.step()` while there is work, and hands every step's
outputs back through `emit` (called on the engine thread: it must only
schedule work on the event loop). Keeping the model's CPU/GPU work off the
event loop keeps heartbeats, cancels and stats answered while a long prefill
runs. A request with a structured output constraint is added once the constraint
has compiled, on the engine's compile threads (`StructuredOutputs.compile`): the
steps of the others go on meanwhile. If the thread dies, `crashed` is set and the
service exits non-zero.
"""

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.cpu_loan import CpuShare
from services.common.engine_thread import EngineThread
from services.common.step_meter import StepMeter
from shared.engine import (
    Continuation, EngineError, InvalidRequestError, LLMEngine, MAX_COMPILE_S, RequestOutput, SamplingParams
)
from shared.telemetry.logging import get_logger

log = get_logger(__name__)

_IDLE_WAIT_S = 0.05
# Work that reaches an idle engine comes in bursts split by the hops before it (the gateway, the scheduler's
# fetch and routing cycle): 16 requests sent at once reached a worker in parts 8-10 ms apart, and the later parts
# waited for a whole prefill step (1.3-2.7 s) that could have taken them too. So a first step from idle waits for
# what follows within GATHER_QUIET_S of the last arrival, at most `gather_s` in all: a lone request's first token
# comes GATHER_QUIET_S later. A busy engine never waits. (A decode worker's `gather_s` is its --gather-ms.)
GATHER_QUIET_S = 0.012


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    continuation: Continuation | None = None
    hold_kv: bool = False
    stream_prompt_kv: bool = False
    read_prefix_cache: bool = True


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class EngineCall:
    """Run `fn(engine)` on the engine thread; its result or exception resolves `future`."""

    fn: Callable
    future: "asyncio.Future"


@dataclass(slots=True)
class _Compiling:
    """An add that waits for its constraint to compile."""

    command: AddRequest
    grammar: concurrent.futures.Future
    deadline: float  # time.monotonic(): refused if it has not compiled by then


@dataclass(slots=True)
class RequestRejected:
    """An add that the engine refused after the handoff was accepted."""

    request_id: str
    error: EngineError


class EngineLoop:
    def __init__(self, engine: LLMEngine, emit: Callable[[list[RequestOutput | RequestRejected]], None],
                 thread: EngineThread, cpu_share: CpuShare | None = None, gather_s: float = 0.0):
        """`thread`: the one the engine was built on; the loop holds it from `start` to `stop`. `cpu_share`: CPUs
        lent to or borrowed from another worker (`services.common.cpu_loan`), told of every step and idle spell.
        `gather_s`: how long a first step from idle may wait for the rest of a burst (0: never; a decode worker
        passes its --gather-ms)."""
        if gather_s < 0:
            raise ValueError(f"gather_s must be >= 0, got {gather_s}")
        self.engine = engine
        self.cpu_share = cpu_share
        self.gather_s = gather_s
        self._emit = emit
        self._thread = thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.crashed: BaseException | None = None
        self._running: concurrent.futures.Future | None = None
        self._compiling: dict[str, _Compiling] = {}  # engine thread only
        self.steps = StepMeter()  # what each step cost (`details()` from any thread)

    def start(self) -> None:
        self._running = self._thread.submit(self._run)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)  # wake the thread
        if self._running is not None:
            try:
                self._running.result(timeout_s)
            except concurrent.futures.TimeoutError:
                log.warning("the engine loop did not stop in time", timeout_s=timeout_s)

    def add(self, command: AddRequest) -> None:
        self._commands.put(command)

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def wake(self) -> None:
        """Step again now (from any thread): what a stalled engine waited for (a connector's answer or load)
        has come."""
        self._commands.put(None)

    def call(self, fn: Callable) -> "asyncio.Future":
        """Run `fn(engine)` between steps; await the returned future (from the event loop)."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(EngineCall(fn, future))
        return future

    def _run(self) -> None:
        share = self.cpu_share
        try:
            if share is not None:
                share.start()
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished_requests()
                # A stalled engine (its requests wait for connectors, or for blocks held outside a step) has
                # nothing to run either: it lends or gives back CPUs, and waits for a command or a wake (or
                # steps again after _IDLE_WAIT_S).
                waiting = idle or self.engine.stalled
                if waiting and share is not None:
                    share.idle()
                rejected, _ = self._apply_commands(_IDLE_WAIT_S if waiting else 0.0)
                if idle and self.engine.has_unfinished_requests():
                    rejected += self._gather_burst()
                outputs = []
                if self.engine.has_unfinished_requests():
                    if share is not None:
                        share.before_step()
                    outputs = self._step()
                if outputs or rejected:
                    self._emit([*rejected, *outputs])
        except BaseException as exc:  # the service must die with it, loudly
            self.crashed = exc
            log.exception("engine loop crashed")
            self._emit([])  # wake the event loop so it notices
        finally:
            if share is not None:  # hand back what was borrowed, drop the loan file
                share.idle()
                share.close()

    def _step(self) -> list:
        """`engine.step()`, measured: its wall time, the sequences it gave a token and the prompt tokens it
        computed (a step that ran nothing, stalled, is not counted)."""
        engine = self.engine
        prompt_before = engine.num_prompt_tokens_computed
        started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - started
        if not engine.stalled:
            self.steps.record(seconds, len(outputs), engine.num_prompt_tokens_computed - prompt_before)
        return outputs

    def _gather_burst(self) -> list[RequestRejected]:
        """Work just reached an idle engine: take what arrives right behind it into the same first step."""
        rejected: list[RequestRejected] = []
        deadline = time.monotonic() + self.gather_s
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            more, applied = self._apply_commands(min(GATHER_QUIET_S, left))
            rejected += more
            if not applied:
                break
        return rejected

    def _apply_commands(self, wait_s: float) -> tuple[list[RequestRejected], int]:
        """Apply every queued command, first waiting up to `wait_s` for one; the rejected adds, and how many
        commands were applied."""
        rejected = []
        applied = 0
        try:
            command = self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait()
            while True:
                applied += 1
                if isinstance(command, AddRequest) and command.params.structured_kind:
                    self._compile(command)
                elif isinstance(command, AddRequest):
                    self._add(command, None, rejected)
                elif isinstance(command, AbortRequest):
                    self._compiling.pop(command.request_id, None)
                    self.engine.abort_request(command.request_id)
                elif isinstance(command, EngineCall):
                    _resolve(command, self.engine)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        if self._compiling:
            rejected += self._take_compiled()
        return rejected, applied

    def _add(self, command: AddRequest, grammar, rejected: list[RequestRejected]) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    command.continuation, hold_kv=command.hold_kv,
                                    stream_prompt_kv=command.stream_prompt_kv,
                                    read_prefix_cache=command.read_prefix_cache, grammar=grammar)
        except EngineError as exc:
            rejected.append(RequestRejected(command.request_id, exc))

    def _compile(self, command: AddRequest) -> None:
        """Have the request's constraint compiled off this thread; it is added once it has (`_take_compiled`)."""
        grammar = self.engine.structured.compile(command.params.structured_kind, command.params.structured_spec)
        self._compiling[command.request_id] = _Compiling(command, grammar, time.monotonic() + MAX_COMPILE_S)
        grammar.add_done_callback(lambda _: self._commands.put(None))  # wake the loop

    def _take_compiled(self) -> list[RequestRejected]:
        """Add the requests whose constraints have compiled; refuse those that did not compile, or not within
        MAX_COMPILE_S."""
        rejected: list[RequestRejected] = []
        now = time.monotonic()
        for request_id, waiting in list(self._compiling.items()):
            if waiting.grammar.done():
                del self._compiling[request_id]
                try:
                    grammar = waiting.grammar.result()
                except EngineError as exc:
                    rejected.append(RequestRejected(request_id, exc))
                except Exception as exc:  # (not the constraint's fault, but the request's end all the same)
                    rejected.append(RequestRejected(request_id, InvalidRequestError(
                        f"the constraint did not compile: {exc!r}", "structured_outputs")))
                else:
                    self._add(waiting.command, grammar, rejected)
            elif now > waiting.deadline:
                del self._compiling[request_id]
                rejected.append(RequestRejected(request_id, InvalidRequestError(
                    f"the {waiting.command.params.structured_kind} constraint did not compile within "
                    f"{MAX_COMPILE_S:g} s", "structured_outputs")))
        return rejected


def _resolve(call: EngineCall, engine: LLMEngine) -> None:
    loop = call.future.get_loop()
    try:
        result = call.fn(engine)
    except Exception as exc:  # the caller decides what a failed call means
        loop.call_soon_threadsafe(_set_exception, call.future, exc)
    else:
        loop.call_soon_threadsafe(_set_result, call.future, result)


def _set_result(future: "asyncio.Future", result) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: "asyncio.Future", exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
