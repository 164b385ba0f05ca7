"""`splitserve scale decode=N` on a pipeline deployment: a pipeline added (its stage, then its head) serves; removed
while a stream runs on it, its head drains and hands the stream back, the stream ends as an undisturbed greedy run
would, and its stage retires once the head is gone. In disagg with a pipelined prefill pool (which does not scale),
a scale of the decode pool leaves the prefill pipeline running."""

from pathlib import Path

import httpx
import pytest

from support.sse import stream, streamed_text
from support.up import ps, start_up
from support.waiting import wait_until
from test_scale import greedy_bodies, retire_under_streams, scale_and_wait, splitserve, undisturbed

TOKENS = 400


def retired_at(log: Path, name: str) -> str:
    """When the supervisor saw `name` exit 0 on its retirement (its log's ISO time: they sort as they fall)."""
    line = next((line for line in log.read_text().splitlines() if f"{name} exited with code 0; retired" in line), None)
    assert line is not None, f"{name} was not retired cleanly: " + log.read_text()[-2000:]
    return line.split()[1]


@pytest.mark.timeout(360)
def test_a_pipeline_added_serves_and_one_removed_mid_stream_loses_nothing(tmp_path, default_model):
    up = start_up(tmp_path / "run", "--topology", "pipeline", "--stages", "2", "--stop-timeout", "6")
    try:
        bodies = greedy_bodies(TOKENS)
        references = undisturbed(up.url, bodies)

        result = scale_and_wait(up.run_dir, "decode=2")
        assert result.returncode == 0, result.stderr
        assert "starting stage-1-p1, stage-0-p1" in result.stdout, result.stdout  # its stage first
        assert "settled: decode 2 ready of 2" in result.stdout, result.stdout
        pools = ps(up.run_dir)["pools"]
        assert pools["decode"] == {"desired": 2, "running": 2, "retiring": 0}  # the heads
        assert pools["stage"] == {"desired": 2, "running": 2, "retiring": 0}
        ready = httpx.get(f"{up.url}/ready", timeout=5).json()
        assert ready["status"] == "ready" and ready["expected"]["stage"] == 2, ready

        retire_under_streams(up, bodies, references, "stage-0-p1", "decode=1")  # the new pipeline's head

        wait_until(lambda: not {"stage-0-p1", "stage-1-p1"} & {s["name"] for s in ps(up.run_dir)["services"]}, 60,
                   "the removed pipeline was not retired", poll_s=0.2)
        exits = [retired_at(up.run_dir / "logs" / f"{name}.log", name) for name in ("stage-0-p1", "stage-1-p1")]
        assert exits[0] <= exits[1], exits  # the stage outlived its head's drain
        pools = ps(up.run_dir)["pools"]
        assert pools["decode"] == {"desired": 1, "running": 1, "retiring": 0}
        assert pools["stage"] == {"desired": 1, "running": 1, "retiring": 0}
        ready = wait_until(lambda: (r := httpx.get(f"{up.url}/ready", timeout=5).json())["status"] == "ready" and r,
                           30, "/ready did not say ready at the new size", poll_s=0.2)
        assert ready["expected"]["decode"] == 1 and ready["expected"]["stage"] == 1
        again = stream(up.url, bodies[0], timeout_s=120)
        assert streamed_text(again) == references[0]
    finally:
        up.stop()


@pytest.mark.timeout(300)
def test_a_pipelined_prefill_pool_stays_as_it_is_while_the_decode_pool_scales(tmp_path, default_model):
    up = start_up(tmp_path / "run", "--topology", "disagg", "--prefill-stages", "2", "--no-kv-store",
                  "--stop-timeout", "6")
    try:
        body = greedy_bodies(16)[0]
        reference = undisturbed(up.url, [body])[0]
        refused = splitserve("scale", "prefill=2", "--run-dir", str(up.run_dir))
        assert refused.returncode == 2 and "it does not scale" in refused.stderr, refused.stderr
        result = scale_and_wait(up.run_dir, "decode=2")
        assert result.returncode == 0 and "starting decode-1;" in result.stdout, (result.stdout, result.stderr)
        services = {s["name"]: s for s in ps(up.run_dir)["services"]}
        for name in ("prefill-0", "prefill-stage-1"):  # neither retired nor restarted by the scale
            assert services[name]["state"] == "running" and services[name]["recorded_state"] != "stopping", services
            assert "retired" not in (up.run_dir / "logs" / f"{name}.log").read_text()
        assert undisturbed(up.url, [body])[0] == reference
    finally:
        up.stop()
