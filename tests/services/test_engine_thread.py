"""A worker's torch work runs on its engine thread with the process's torch threads; other threads use one.

Runs in a fresh interpreter: the thread counts are process-wide state.
"""

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import asyncio, threading, torch
    from services.common.engine_thread import EngineThread

    torch.set_num_threads(2)  # as `--cpus` with two CPUs sets it

    async def main():
        engine_thread = EngineThread()
        first = await engine_thread.run(torch.get_num_threads)
        x = torch.randn(512, 512)
        await engine_thread.run(lambda: x @ x)  # a parallel op: torch's lazy per-thread setup has run there
        later = await engine_thread.run(torch.get_num_threads)
        other = []
        thread = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        thread.start(); thread.join()
        print(first, later, torch.get_num_threads(), other[0])

    asyncio.run(main())
""")


def test_engine_thread_keeps_the_threads_and_every_other_thread_gets_one():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    engine_first, engine_later, event_loop, started_later = map(int, result.stdout.split())
    assert (engine_first, engine_later) == (2, 2)
    assert (event_loop, started_later) == (1, 1)
