"""Scaling a running deployment's decode and prefill pools, each model's, for `splitserve up`'s launcher.

Two sides. The control API's threads (`handle`) never touch the supervisor: a scale is put on a bounded queue and
its outcome awaited with a deadline; a read gets the view the main loop last published. The launcher's main loop
(`step`, between supervision rounds) takes the queued scales, sets the desired counts, and reconciles: planned
instances that do not run get credentials, are admitted by the embedded NATS server (its config rewritten and
reloaded: `bus_admission`) and start; running ones no longer planned are retired (SIGTERM: a decode worker drains
and hands its streams to the gateway, which moves them; SIGKILL at the stop timeout), and once gone their credentials
are revoked. Each model's pools are its own (`--model NAME` in `splitserve scale`; the first model's by default); a
CPU handover moves the running workers only in a deployment of one model. Models served and unserved at runtime:
`services.launcher.model_changes`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import queue
import time
from typing import Any

from services.common.settings import Settings

from services.common.cpu_placement import Placement, placement_acked, read_ack, write_placement
from services.common.cpus import format_cpu_list, share_cpus
from services.launcher import topology
from services.launcher.admin_bus import ready_in_registry
from services.launcher.bus_admission import Admission
from services.launcher.cpu_handover import Handover, HandoverError, Step, handover_steps
from services.launcher.nats_auth import creds_path
from services.launcher.placement import place_new_workers
from services.launcher.scale_policy import (
    SCALABLE,
    WORKER_POOLS,
    ScaleError,
    check_scale,
    desired_pools,
    pool_sizes,
    reconcile,
    sized,
)
from services.launcher.served_models import FurtherModel
from services.launcher.supervisor import SupervisorError
from services.launcher.switch_policy import planned_names

QUEUE_SIZE = 8
ANSWER_TIMEOUT_S = 30.0  # a scale's outcome: the main loop takes it within a round, admission included
# A CPU handover's round: its placements acked (within a few engine steps), its started workers' first acks (once
# their model loaded); a round that stops workers has their stop timeout on top.
HANDOVER_ROUND_TIMEOUT_S = 120.0


class Scaler:
    """The launcher's scaling: `handle` on the control API's threads, `step` on the main loop's."""

    def __init__(self, launcher: Any, specs: list[topology.ServiceSpec], probe) -> None:
        self.launcher = launcher  # its supervisor, deployment, bus and settings are the main loop's
        self.probe = probe  # (url) -> (HTTP status or None, body): the gateway's /ready
        self.requests: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.first = launcher.deployment.models[0].name  # the first model's served name
        self.models: dict[str, FurtherModel] = {m.served_name: m for m in launcher.further}  # the further ones
        # each model's scalable pools' sizes asked for
        self.pools: dict[str, dict[str, int]] = {self.first: desired_pools(launcher.options),
                                                  **{n: desired_pools(m.up) for n, m in self.models.items()}}
        # each pinned worker's CPUs, as it last acked them (as started, before its first ack)
        self.placements = {s.name: tuple(s.settings.cpus) for s in specs if getattr(s.settings, "cpus", None)}
        self.cpus_files = {s.name: s.settings.cpus_file for s in specs if getattr(s.settings, "cpus_file", None)}
        self.generations: dict[str, int] = {name: 0 for name in self.cpus_files}  # the placement written last
        loans = {s.settings.cpu_loan: s.name for s in specs if s.role == "prefill" and
                 getattr(s.settings, "cpu_loan", None)}
        self.loans = {s.name: loans[s.settings.cpu_loan] for s in specs if s.role == "decode" and
                      getattr(s.settings, "cpu_loan", None) in loans}  # borrower -> lender, as `up` paired them
        self.handover: Handover | None = None  # moving the workers to a new share of the CPUs (a scale)
        self._handover_starts: dict[str, topology.ServiceSpec] = {}  # the workers the handover starts
        self._said: set[str] = set()  # why scales did not hand CPUs over, each kind said once
        self._plans: dict[tuple, list[topology.ServiceSpec]] = {}
        self._view: dict = {}
        # workers switched to the other pool: name -> (its role now, the pid that switched; a restart undoes it)
        self.switched: dict[str, tuple[str, int | None]] = {}
        from services.launcher.model_changes import ModelChanges
        from services.launcher.switcher import Switches  # (it imports the NATS client)

        self.switches = Switches(self)
        self.model_changes = ModelChanges(self)
        self.admission = Admission(launcher)

    @property
    def desired(self) -> dict[str, int]:
        """The first model's pools' sizes asked for."""
        return self.pools[self.first]

    def up_of(self, model: str):
        """A model's settings (up's own for the first)."""
        return self.launcher.options if model == self.first else self.models[model].up

    def cpus_of(self, model: str) -> tuple[int, ...]:
        """The CPUs a model's workers are placed on."""
        run = self.launcher.resolved
        return run.cpus if model == self.first else topology.run_of(run, self.models[model]).cpus

    def members(self, model: str, roles=SCALABLE) -> list:
        """The supervisor's children in the pools `roles` (`topology.pool_of`) that serve `model` (running or
        retiring)."""
        namespace, planned = self.up_of(model).namespace, self.launcher.planned
        return [c for c in self.launcher.supervisor.children
                if c.name in planned and topology.pool_of(planned[c.name]) in roles
                and planned[c.name].namespace == namespace]

    def pool_now(self, child) -> str:
        """The pool a child serves in now: the one it switched to, else its planned one (`topology.pool_of`)."""
        spec = self.launcher.planned.get(child.name)
        return self.switched.get(child.name, (topology.pool_of(spec) if spec else child.role, None))[0]

    # -- the control API's side -------------------------------------------------

    def handle(self, method: str, route: str, body: object) -> tuple[int, dict]:
        if route == "/v1/deployment" and method == "GET":
            return 200, self.view()
        if route == "/v1/scale" and method == "POST":
            return self.submit(lambda: self._apply(body) if isinstance(body, dict) else
                               (400, {"error": 'the body is {"ROLE": N, ..., "model": NAME}'}))
        if route == "/v1/switch" and method == "POST":
            return self.switches.handle(body)
        if route.split("/")[:3] == ["", "v1", "models"]:
            return self.model_changes.handle(method, route, body)
        return 404, {"error": f"no {method} {route} (GET /v1/deployment, POST /v1/scale, POST /v1/switch, "
                              "GET|POST /v1/models, DELETE /v1/models/NAME)"}

    def view(self) -> dict:
        """What the main loop last published, with the gateway's ready counts now, and whether it has settled."""
        view = dict(self._view)
        status, said = self.probe(view["ready_url"]) if view else (None, "")
        try:
            ready = json.loads(said).get("ready", {}) if status is not None else {}
        except (ValueError, AttributeError):
            ready = {}
        view["ready"] = ready
        published = bool(self._view)
        view["models"] = {name: {**pools, "ready": self.registered(name)}
                          for name, pools in view.get("models", {}).items()}
        view["settled"] = published and not view.get("cpu_handover") and all(
            settled(pools) for pools in [view, *view["models"].values()])
        return view

    def registered(self, model: str) -> dict[str, int]:
        """(control API's thread) How many of each role a further model's registry holds ready; none where it
        cannot be read."""
        launcher = self.launcher
        model_now = self.models.get(model)
        if model_now is None or not launcher.reads_registries():
            return {}
        run = launcher.resolved
        try:
            return ready_in_registry(run.nats_url, model_now.namespace, launcher.admin, run.nats_tls_ca)
        except Exception:  # the bus busy: asked again on the next read
            return {}

    def submit(self, apply) -> tuple[int, dict]:
        """`apply()` run on the main loop; its answer, waited for with a deadline."""
        outcome: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.requests.put_nowait((apply, outcome))
        except queue.Full:
            return 503, {"error": "too many scales waiting; try again"}
        try:
            return outcome.result(timeout=ANSWER_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return 504, {"error": f"the launcher did not take the scale within {ANSWER_TIMEOUT_S:g} s"}

    # -- the main loop's side ---------------------------------------------------

    def step(self) -> None:
        """Take the queued scales, reconcile, publish the view."""
        self._forget_restarted()
        for apply, outcome in self._queued():
            try:
                outcome.set_result(apply())
            except OSError as exc:  # e.g. the NATS config not written: said, and the deployment serves on
                outcome.set_result((500, {"error": f"the scale could not be applied: {exc}"}))
        try:
            self.reconcile()
            self.model_changes.step()
            self.admission.admit()  # an instance gone: its credential revoked
        except OSError as exc:
            self.launcher.say(f"warning: scaling: {exc}")

    def refuse_pending(self) -> None:
        """The deployment stops: every scale still queued is answered so."""
        for _, outcome in self._queued():
            outcome.set_result((503, {"error": "the deployment is stopping"}))

    def _queued(self):
        """The scales waiting, taken off the queue one by one."""
        while True:
            try:
                yield self.requests.get_nowait()
            except queue.Empty:
                return

    def _apply(self, body: dict) -> tuple[int, dict]:
        body = dict(body)
        model = body.pop("model", None) or self.first
        try:
            if model not in self.pools:
                raise ScaleError(f"no model is served as {model!r} (`splitserve models served` lists them)")
            up = self.up_of(model)
            counts = check_scale(body, up.topology, up.prefill_stages is not None, up.runs_kv_store)
            self._check_external_credentials(model, counts)
        except ScaleError as exc:
            return 400, {"error": str(exc)}
        desired = self.pools[model]
        before = dict(desired)
        desired.update(counts)
        busy = self.handover is not None
        started, retired = self.reconcile()
        after = " (once the CPU handover under way is done)" if busy else ""
        which = "" if model == self.first else f" of model {model}"
        self.launcher.say(f"scale{which} {', '.join(f'{r}={n}' for r, n in counts.items())} (was "
                          f"{', '.join(f'{r}={n}' for r, n in before.items())}): starting {started or 'none'}, "
                          f"retiring {retired or 'none'}{after}")
        return 200, {"model": model, "desired": dict(desired), "starting": started, "retiring": retired}

    def roles_now(self, model: str | None = None) -> dict[str, str]:
        """Every scalable worker (running or retiring; `model`'s alone where named) and the role it serves as
        now."""
        children = self.launcher.supervisor.children if model is None else self.members(model)
        roles = {c.name: self.pool_now(c) for c in children}
        return {name: role for name, role in roles.items() if role in SCALABLE}

    def apply_switch(self, name: str, to: str, pid: int | None) -> tuple[int, dict]:
        """(main loop) Worker `name` (process `pid`) serves as `to` now: counted in that pool from now on."""
        before = self.roles_now(self.first).get(name)
        if before is None:
            return 409, {"error": f"{name} switched, but is gone from the deployment meanwhile"}
        self.switched[name] = (to, pid)
        if before != to:
            for role, change in ((before, -1), (to, 1)):
                if role in self.desired:
                    self.desired[role] = max(1, self.desired[role] + change)
        self.launcher.say(f"switched {name} from {before} to {to}: desired "
                          f"{', '.join(f'{r}={n}' for r, n in self.desired.items())}")
        self.publish()
        return 200, {"desired": dict(self.desired)}

    def _forget_restarted(self) -> None:
        """A switched worker that restarted runs in its planned role again: the reconcile evens the pools out."""
        pids = {c.name: c.pid for c in self.launcher.supervisor.children}
        for name, (role, pid) in list(self.switched.items()):
            if pids.get(name, -1) != pid:
                del self.switched[name]
                if name in pids:
                    self.launcher.say(f"warning: {name} restarted in its planned role (it served as {role})")

    def _check_external_credentials(self, model: str, counts: dict[str, int]) -> None:
        """A --nats server's instances need their credentials in --nats-creds-dir before they can start."""
        missing = self.lacking_credentials(self._planned(model, {**self.pools[model], **counts}))
        if missing:
            raise ScaleError(missing)

    def lacking_credentials(self, specs: list[topology.ServiceSpec]) -> str | None:
        """Why some of `specs` cannot start on a --nats server (their credentials are not in --nats-creds-dir)."""
        creds_dir = self.launcher.options.nats_creds_dir
        if creds_dir is None:
            return None
        missing = [s.instance_id for s in specs if not creds_path(creds_dir, s.instance_id).is_file()]
        return (f"--nats-creds-dir {creds_dir} lacks the credentials of: {', '.join(missing)} (`splitserve nats-auth "
                "DIR --instance ROLE:ID[@NAMESPACE] ...` writes them)") if missing else None

    def _planned(self, model: str, desired: dict[str, int]) -> list[topology.ServiceSpec]:
        """A model's scalable pools' instances for `desired` (planned once per set of counts)."""
        key = (model, tuple(sorted(desired.items())))
        if key not in self._plans:
            run = self.launcher.resolved
            if model == self.first:
                specs = topology.plan(sized(self.launcher.options, desired), run)
            else:
                further = self.models[model]
                specs = topology.model_services(run, dataclasses.replace(further,
                                                                         up=sized(further.up, desired)))
            self._plans[key] = [s for s in specs if topology.pool_of(s) in (*SCALABLE, "stage")]
        return self._plans[key]

    def counted_sizes(self, model: str) -> dict[str, int]:
        """A model's pools' sizes asked for as its registry counts them, a pipeline's stages after its heads too:
        what the gateway's /ready and `splitserve ps` judge the deployment by."""
        desired = self.pools[model]
        if not desired:
            return {}
        run = self.launcher.resolved
        run = run if model == self.first else topology.run_of(run, self.models[model])
        stages = topology.expected_counts(sized(self.up_of(model), desired), run).get("stage")
        return {**desired, **({"stage": stages} if stages is not None else {})}

    def forget_plans(self, model: str) -> None:
        self._plans = {key: specs for key, specs in self._plans.items() if key[0] != model}

    def reconcile(self) -> tuple[list[str], list[str]]:
        """Start what is planned and not running, retire what runs and is not planned, in every model's pools;
        (started, retired)."""
        if self.handover is not None:  # one handover at a time: what changed meanwhile is reconciled after it
            self._advance_handover()
            if self.handover is not None:
                self.publish()
                return [], []
        started, retired = [], []
        for model, desired in self.pools.items():
            start, retire = self._reconcile_model(model, desired) if desired else ([], [])
            started += start
            retired += retire
            if self.handover is not None:
                break
        self.publish()
        return started, retired

    def _reconcile_model(self, model: str, desired: dict[str, int]) -> tuple[list[str], list[str]]:
        sup = self.launcher.supervisor
        # Only the pools that scale: disagg's pipelined prefill pool (its head counted as prefill) is left alone.
        pool = {c.name: c for c in self.members(model, roles=tuple(desired))}
        # Planned for more workers than run: names enough for every pool past the workers switched out of it.
        specs = {s.name: s for s in self._planned(model, {r: n + len(pool) for r, n in desired.items()})}
        plan = {role: [n for n, s in specs.items() if topology.pool_of(s) == role] for role in desired}
        planned = {n: specs.get(n) for n in with_stages(planned_names(desired, plan, self.roles_now(model)), specs)}
        started = self.launcher.planned  # every service started, gone ones included
        owner = {stage: topology.pool_of(spec) for spec in started.values() for stage in topology.stages_of(spec)}
        running = {**pool, **{c.name: c for c in self.members(model, roles=("stage",)) if owner.get(c.name) in desired}}
        retiring = [n for n, c in running.items() if c.state.value == "stopping"]
        start, retire = reconcile(list(planned), [n for n in running if n not in retiring], retiring)
        # A pipeline's stages outlive its head (its streams drain through them): they retire once it is gone.
        held = {stage for c in self.launcher.supervisor.children if c.name in started
                for stage in topology.stages_of(started[c.name])}
        retire = [n for n in retire if n not in held]
        # The workers' changes may move the running workers' CPUs (a handover); the kv-stores' and the pipelines'
        # start and retire now.
        start_workers = [n for n in start if planned[n].role in WORKER_POOLS]
        retire_workers = [n for n in retire if running[n].role in WORKER_POOLS]
        self.admission.admit([planned[n] for n in start])  # every new instance's credential, once
        for name in (n for n in retire if n not in retire_workers):
            sup.retire(name, self.launcher.retire_timeout_s)
        self.start_services([planned[n] for n in start if n not in start_workers], self.cpus_of(model))
        if ((start_workers or retire_workers)
                and self._begin_handover(list(specs), {n: planned[n] for n in start_workers}, retire_workers)):
            self._advance_handover()
            return start, retire
        for name in retire_workers:
            sup.retire(name, self.launcher.retire_timeout_s)
        self.start_services([planned[n] for n in start_workers], self.cpus_of(model))
        return start, retire

    # -- moving the running workers to a new share of the CPUs (services.launcher.cpu_handover) ------------

    def _begin_handover(self, order: list[str], start: dict[str, topology.ServiceSpec], retire: list[str]) -> bool:
        """A handover to the share `up` would give the workers that will run (False: none; start and retire as
        without one). `order`: the plan's order of the names."""
        cpus = self.launcher.resolved.cpus
        if not cpus:
            return False
        if len(self.pools) > 1:
            return self._no_handover("models", "the deployment serves several models")
        children = {c.name: c for c in self.launcher.supervisor.children}
        old = {n: held for n, held in self.placements.items() if n in children}
        unmovable = sorted(n for n in old if n not in self.cpus_files)
        stay = [n for n, c in children.items() if c.role in WORKER_POOLS and c.state.value != "stopping"
                and n not in retire]
        will_run = [n for n in order if n in set(stay) | set(start)]
        will_run += [n for n in [*stay, *start] if n not in will_run]
        if unmovable or any(n not in old for n in [*stay, *retire]):
            return self._no_handover("unmovable", f"{', '.join(unmovable) or 'a worker'} follows no placement file")
        new = share_cpus(will_run, cpus)
        old_loans = {b: lender for b, lender in self.loans.items() if b in old and lender in old}
        new_loans = {b: lender for b, lender in old_loans.items() if b in new and lender in new}
        try:
            rounds = handover_steps(old, new, old_loans, new_loans)
        except HandoverError as exc:
            return self._no_handover("error", str(exc))
        stops = self.launcher.retire_timeout_s + HANDOVER_ROUND_TIMEOUT_S
        self.handover = Handover(rounds, old, [stops if any(s.action == "stop" for s in r) else
                                               HANDOVER_ROUND_TIMEOUT_S for r in rounds])
        self._handover_starts = dict(start)
        moves = ", ".join(f"{n} to CPUs {format_cpu_list(c)}" for n, c in new.items())
        self.launcher.say(f"CPU handover begins: {moves} in {len(rounds)} round(s)")
        return True

    def _no_handover(self, kind: str, why: str) -> bool:
        if kind not in self._said:  # each kind once: the next scale would say it again
            self._said.add(kind)
            self.launcher.say(f"warning: no CPU handover ({why}): the running workers stay on their CPUs, new ones "
                              "start on free CPUs")
        return False

    def _advance_handover(self) -> None:
        """The handover's next steps taken, once those before them are acked; its end, or where it stopped."""
        handover = self.handover
        assert handover is not None
        for step in handover.advance(time.monotonic(), self._step_status):
            self._take(step)
        if handover.done:
            self.launcher.say("CPU handover done")
        elif handover.failed:
            held = ", ".join(f"{n} on {format_cpu_list(c)}" for n, c in handover.held.items())
            unstarted = [self._handover_starts[n] for n in handover.unstarted()]
            self.launcher.say(f"warning: CPU handover stopped: {handover.failed}; every worker stays where it last "
                              f"acked ({held})" + (f"; {', '.join(s.name for s in unstarted)} start on free CPUs"
                                                   if unstarted else ""))
            self.start_services(unstarted, self.launcher.resolved.cpus)
        if handover.over:
            self.handover, self._handover_starts = None, {}

    def _take(self, step: Step) -> None:
        sup = self.launcher.supervisor
        try:
            if step.action == "stop":
                if sup.child(step.worker).state.value != "stopping":
                    sup.retire(step.worker, self.launcher.retire_timeout_s)
            elif step.action == "place":
                generation = self.generations.get(step.worker, 0) + 1
                write_placement(self.cpus_files[step.worker], Placement(generation, step.cpus, step.borrow_cpus))
                self.generations[step.worker] = generation
            else:
                spec = self._handover_starts[step.worker]
                self.launcher.start_service(dataclasses.replace(spec, settings=spec.settings.model_copy(update={
                    "cpus": step.cpus, "cpu_loan": None, **({"borrow_cpus": None} if spec.role == "decode" else {})})))
                self.placements[step.worker] = step.cpus
                self.cpus_files[step.worker] = spec.settings.cpus_file
                self.generations[step.worker] = 0
        except (OSError, SupervisorError) as exc:
            assert self.handover is not None
            self.handover.refuse(step, str(exc))

    def _step_status(self, step: Step) -> bool | str | None:
        """(Handover.advance) True once `step` is acked, why it was refused, or None."""
        name = step.worker
        if step.action == "stop":
            done = name not in {c.name for c in self.launcher.supervisor.children}
            if done:
                self.placements.pop(name, None)
                self.launcher.say(f"CPU handover: {name} stopped")
            return done or None
        path = self.cpus_files.get(name)
        if path is None:
            return "it follows no placement file"
        acked = placement_acked(path, self.generations[name])
        if acked is None:
            return None
        if not acked:
            ack = read_ack(path)
            return (ack.error if ack is not None else "") or "refused"
        self.placements[name] = step.cpus
        self.launcher.say(f"CPU handover: {name} on CPUs {format_cpu_list(step.cpus)}"
                          + (f", borrowing {format_cpu_list(step.borrow_cpus)}" if step.borrow_cpus else ""))
        return True

    def start_services(self, new: list[topology.ServiceSpec], cpus: tuple[int, ...]) -> None:
        """New services, the model workers on CPUs of `cpus` the running ones do not use (where there are enough),
        lending and borrowing none."""
        placed = place_new_workers(self.placements, [s.name for s in new if s.role in topology.ENGINE_ROLES], cpus)
        for spec in new:
            settings = _placed(spec.settings, placed.get(spec.name))
            try:
                self.launcher.start_service(dataclasses.replace(spec, settings=settings))
            except SupervisorError as exc:  # the rest of the deployment serves on
                self.launcher.say(f"warning: {exc}")
                continue
            if spec.name in placed:
                self.placements[spec.name] = placed[spec.name]
                if getattr(spec.settings, "cpus_file", None):  # it follows its file: a later scale may move it
                    self.cpus_files[spec.name], self.generations[spec.name] = spec.settings.cpus_file, 0

    def publish(self) -> None:
        """The view the control API serves (the first model's pools at its top, every further model's under
        "models"), and deployment.json's records of the pools."""
        launcher = self.launcher
        children = {c.name: c for c in launcher.supervisor.children}
        dep = launcher.deployment
        dep.services = [rec for rec in dep.services if rec.name in children]
        self.placements = {n: cpus for n, cpus in self.placements.items() if n in children}
        dep.desired = self.counted_sizes(self.first)
        for record in dep.models:
            if record.name in self.pools:
                record.desired = self.counted_sizes(record.name)
        roles = self.roles_now()
        for rec in dep.services:  # `splitserve ps` shows each worker in the pool it serves now, on its CPUs
            rec.role = roles.get(rec.name, rec.role)
            if rec.name in self.placements:
                rec.cpus = format_cpu_list(self.placements[rec.name])
        handover = self.handover
        first = self._pools_view(self.first, children)
        self._view = {"state": dep.state, **first, "ready_url": (dep.gateway_url or "") + "/ready",
                      "role_switch": bool(launcher.options.role_switch),
                      "cpu_handover": None if handover is None else {
                          "round": handover.round + 1, "rounds": len(handover.rounds),
                          "awaiting": sorted(handover.awaiting)},
                      "models": {name: {"namespace": model.namespace, **self._pools_view(name, children)}
                                 for name, model in self.models.items() if name in self.pools}}

    def _pools_view(self, model: str, children: dict) -> dict:
        roles = self.roles_now(model)
        retiring = [n for n in roles if children[n].state.value == "stopping"]
        return {"desired": dict(self.pools[model]), "actual": pool_sizes(roles, retiring), "retiring": retiring,
                "services": {n: {"role": roles[n], "state": children[n].state.value, "pid": children[n].pid,
                                 **({"cpus": format_cpu_list(self.placements[n])} if n in self.placements else {}),
                                 **({"planned_role": children[n].role} if roles[n] != children[n].role else {})}
                             for n in roles}}


def with_stages(heads: list[str], specs: dict[str, topology.ServiceSpec]) -> list[str]:
    """`heads` with each pipeline head's stages before it (the order they start in)."""
    names: list[str] = []
    for name in heads:
        spec = specs.get(name)
        names += [*(topology.stages_of(spec) if spec is not None else ()), name]
    return names


def settled(pools: dict) -> bool:
    """Whether one model's pools (a view's `desired`, `actual`, `retiring`, `ready`) have their sizes, every
    worker ready and none retiring."""
    ready = pools.get("ready") or {}
    return not pools["retiring"] and all(pools["actual"].get(role) == n and ready.get(role, 0) >= n
                                         for role, n in pools["desired"].items())


def _placed(settings: Settings, cpus: tuple[int, ...] | None) -> Settings:
    """A service's settings on `cpus` (None: the OS places it), lending and borrowing none; only the fields its
    settings have."""
    update = {"cpus": cpus, "cpu_loan": None, "borrow_cpus": None}
    return settings.model_copy(update={k: v for k, v in update.items() if k in type(settings).model_fields})
