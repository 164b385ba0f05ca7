"""The planner's loop against a fake deployment: scrapes built here, a control API that records what it is asked."""

import threading

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.planner.loop import CallFailed, Calls, run, tick
from services.planner.metrics import reason_label
from services.planner.planner import Planner, change_call
from services.planner.policy import Decision, Slo
from support.exposition import counter, histogram, steps

WINDOW_S = 10.0


def slow_prompts(k: int) -> str:
    """The k-th scrape of a deployment whose prompts take 1-2.5 s to a first token: a prefill worker computing
    1000 tokens a busy second, one 1000-token prompt a window."""
    ttft = {"0.1": 0, "1": 0, "2.5": 10 * k, "+Inf": 10 * k}
    return (histogram("vllm:time_to_first_token_seconds", ttft)
            + counter("splitserve_disagg_decisions", {'service="scheduler",instance="s",decision="remote"': k})
            + counter("splitserve_prompt_tokens_computed", {'service="prefill",instance="prefill-0"': 1000 * k})
            + steps("prefill-0", "prefill", prompt=(k, 1.0 * k, k), prompt_tokens=1000 * k))


def view(prefill=1, decode=1, **changes) -> dict:
    pools = {"decode": decode, **({"prefill": prefill} if prefill else {})}
    return {"state": "ready", "desired": pools, "actual": dict(pools), "retiring": [], **changes}


class FakeDeployment:
    def __init__(self, view: dict, scrape=slow_prompts):
        self.view, self.scrape, self.k = view, scrape, 0
        self.scales: list[dict] = []
        self.fail_scrape = False

    def metrics(self) -> str:
        if self.fail_scrape:
            raise CallFailed("scrape", "GET http://gateway/metrics: timed out")
        self.k += 1
        return self.scrape(self.k)

    def control(self, method, route, body):
        if method == "POST":
            self.scales.append(body if route == "/v1/scale" else (route, body))
            return 200, {"desired": body, "starting": [], "retiring": []}
        return 200, self.view

    @property
    def calls(self) -> Calls:
        return Calls(self.metrics, self.control)


def planner(budget=4, patience=3, cooldown_s=0.0) -> Planner:
    return Planner(Slo(ttft_ms=500, itl_ms=1000), budget, headroom=0.8, patience=patience, cooldown_s=cooldown_s)


def counted(p: Planner) -> dict:
    text = generate_latest(p.metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def evaluations(p: Planner, dep: FakeDeployment, n: int, dry_run=False) -> list:
    return [tick(p, dep.calls, WINDOW_S * i, dry_run) for i in range(n)]


def test_a_ttft_miss_adds_a_prefill_worker_after_patience(caplog):
    p, dep = planner(), FakeDeployment(view())
    found = evaluations(p, dep, 4)
    assert found[0] is None  # the first scrape: no window yet
    assert [ev.decision.action for ev in found[1:]] == ["hold", "hold", "add"]
    assert found[1].decision.reason.startswith("waiting (1/3)") and found[1].wanted == (2, 1)
    assert dep.scales == [{"prefill": 2, "decode": 1}]
    metrics = counted(p)
    assert metrics[("splitserve_planner_decisions_total", (("action", "add"), ("reason", "ttft")))] == 1
    assert metrics[("splitserve_planner_decisions_total", (("action", "hold"), ("reason", "waiting")))] == 2
    assert metrics[("splitserve_planner_desired_workers", (("role", "prefill"),))] == 2
    assert metrics[("splitserve_planner_scales_total", (("outcome", "ok"),))] == 1
    assert metrics[("splitserve_planner_observed", (("figure", "ttft_p90_ms"),))] == pytest.approx(2350)


def test_a_dry_run_says_what_it_would_do_and_asks_nothing(capsys):
    p, dep = planner(), FakeDeployment(view())
    found = evaluations(p, dep, 4, dry_run=True)
    assert found[-1].decision.action == "add" and dep.scales == []
    metrics = counted(p)
    assert metrics[("splitserve_planner_scales_total", (("outcome", "dry_run"),))] == 1
    assert metrics[("splitserve_planner_decisions_total", (("action", "add"), ("reason", "ttft")))] == 1


def test_nothing_is_decided_while_a_scale_is_under_way():
    p, dep = planner(patience=1), FakeDeployment(view(actual={"prefill": 1, "decode": 0}))
    assert evaluations(p, dep, 3) == [None, None, None] and dep.scales == []


def test_a_failed_scrape_is_counted_and_the_loop_goes_on():
    p, dep = planner(patience=1), FakeDeployment(view())
    tick(p, dep.calls, 0.0, False)
    dep.fail_scrape = True
    assert tick(p, dep.calls, 10.0, False) is None
    dep.fail_scrape = False
    assert tick(p, dep.calls, 20.0, False).decision.action == "add"
    assert counted(p)[("splitserve_planner_failures_total", (("call", "scrape"),))] == 1


def test_a_colocated_deployment_scales_its_decode_pool_only():
    decision = Decision(prefill=0, decode=3, action="add", reason="itl p90 over its slo")
    assert change_call(decision, view(prefill=0, decode=2)) == ("/v1/scale", {"decode": 3})
    assert change_call(Decision(0, 2, "hold", "slo met"), view(prefill=0, decode=2)) is None


def workers(**roles) -> dict:
    """The view's services: NAME=ROLE, or NAME=(ROLE, STATE)."""
    return {name: {"role": r[0], "state": r[1]} if isinstance(r, tuple) else {"role": r, "state": "running"}
            for name, r in roles.items()}


@pytest.mark.parametrize("decision, services, call", [
    # without --role-switch a switch is one scale: one pool's worker removed, the other's added
    (Decision(2, 1, "switch", "ttft"), None, ("/v1/scale", {"prefill": 2, "decode": 1})),
    # with it, the newest running worker of the losing pool changes role in place
    (Decision(2, 1, "switch", "ttft"), workers(**{"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill"}),
     ("/v1/switch", {"instance": "decode-1", "to": "prefill"})),
    (Decision(2, 1, "switch", "ttft"), workers(**{"decode-0": "decode", "decode-1": ("decode", "stopping"),
                                                  "prefill-0": "prefill"}),
     ("/v1/switch", {"instance": "decode-0", "to": "prefill"})),
    (Decision(0, 3, "switch", "itl"), workers(**{"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill"}),
     ("/v1/switch", {"instance": "prefill-0", "to": "decode"})),
    # a switched-in worker counts in the pool it serves now
    (Decision(0, 3, "switch", "itl"), workers(**{"decode-0": "decode", "decode-1": "prefill", "prefill-0": "decode"}),
     ("/v1/switch", {"instance": "decode-1", "to": "decode"})),
    # no running worker to switch: a scale
    (Decision(2, 1, "switch", "ttft"), workers(**{"decode-0": ("decode", "starting"), "prefill-0": "prefill"}),
     ("/v1/scale", {"prefill": 2, "decode": 1})),
    # adds and removes are scales either way
    (Decision(1, 3, "add", "itl"), workers(**{"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill"}),
     ("/v1/scale", {"prefill": 1, "decode": 3})),
])
def test_the_change_call(decision, services, call):
    changes = {"role_switch": True, "services": services} if services is not None else {}
    assert change_call(decision, view(prefill=1, decode=2, **changes)) == call


def slow_prompts_quick_decodes(k: int) -> str:
    """`slow_prompts`, and two decode workers stepping 10 times a window at 1 then 2 sequences a step (10 ms + 1 ms
    a sequence): one decode worker is plenty, a second prefill worker is wanted."""
    seqs = sum(1 + j % 2 for j in range(k))  # sequences per step, summed over the windows so far
    decode = (10 * k, 10 * (0.010 * k + 0.001 * seqs), 10 * seqs)
    return slow_prompts(k) + "".join(steps(f"decode-{i}", decode=decode) for i in range(2))


def test_the_loop_switches_in_place_where_it_may():
    p = planner(budget=3, patience=1)
    dep = FakeDeployment(view(prefill=1, decode=2, role_switch=True,
                              services=workers(**{"decode-0": "decode", "decode-1": "decode", "prefill-0": "prefill"})),
                         scrape=slow_prompts_quick_decodes)
    found = evaluations(p, dep, 4)
    assert [ev.decision.action for ev in found[1:]][:2] == ["hold", "switch"]  # first the decode fit needs 2 points
    assert dep.scales[0] == ("/v1/switch", {"instance": "decode-1", "to": "prefill"})


@pytest.mark.parametrize("reason, label", [
    ("ttft p90 2350 ms over its slo of 500", "ttft"), ("waiting (1/3): ttft p90", "waiting"),
    ("cooling down: itl", "cooling"), ("slo met", "slo"), ("", "none"), ("budget shared; itl", "budget"),
])
def test_the_reason_label_is_its_first_word(reason, label):
    assert reason_label(reason) == label


def test_the_loop_runs_until_stopped():
    p, dep = planner(), FakeDeployment(view())
    stop = threading.Event()
    ticks = iter(range(100))

    def clock() -> float:
        n = next(ticks)
        if n >= 9:  # two clock readings a round: five rounds
            stop.set()
        return n * WINDOW_S

    run(p, dep.calls, interval_s=0.0, dry_run=False, stop=stop, clock=clock)
    assert dep.k == 5 and dep.scales == [{"prefill": 2, "decode": 1}]
