"""Scaling a running deployment's decode and prefill pools, for `splitserve up`'s launcher.

Two sides. The control API's threads (`handle`) never touch the supervisor: a scale is put on a bounded queue and
its outcome awaited with a deadline; a read gets the view the main loop last published. The launcher's main loop
(`step`, between supervision rounds) takes the queued scales, sets the desired counts, and reconciles: planned
instances that do not run get credentials, are admitted by the embedded NATS server (its config rewritten and
reloaded) and start; running ones no longer planned are retired (SIGTERM: a decode worker drains and hands its
streams to the gateway, which moves them; SIGKILL at the stop timeout), and once gone their credentials are revoked.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import queue
import time
from typing import Any

from services.common.cpu_placement import Placement, placement_acked, read_ack, write_placement
from services.common.cpus import format_cpu_list, share_cpus
from services.launcher import topology
from services.launcher.cpu_handover import Handover, HandoverError, Step, handover_steps
from services.launcher.nats_auth import ADMIN_INSTANCE, Instance, creds_path, ensure_credentials, public_key
from services.launcher.nats_auth import write_server_config
from services.launcher.nats_server import admits
from services.launcher.placement import place_new_workers
from services.launcher.scale_policy import SCALABLE, ScaleError, check_scale, pool_sizes, reconcile
from services.launcher.supervisor import SupervisorError
from services.launcher.switch_policy import planned_names
from shared.bus.permissions import ROLES

QUEUE_SIZE = 8
ANSWER_TIMEOUT_S = 30.0  # a scale's outcome: the main loop takes it within a round, admission included
ADMIT_TIMEOUT_S = 5.0  # the reloaded NATS server admitting the new instances
# A CPU handover's round: its placements acked (within a few engine steps), its started workers' first acks (once
# their model loaded); a round that stops workers has their stop timeout on top.
HANDOVER_ROUND_TIMEOUT_S = 120.0


def desired_pools(up) -> dict[str, int]:
    """The pools `up`'s settings ask for that scale: decode, and disagg's prefill pool unless it is a pipeline."""
    if up.topology == "pipeline":
        return {}
    pools = {"decode": up.decode}
    if up.topology == "disagg" and up.prefill_stages is None:
        pools["prefill"] = up.prefill
    return pools


class Scaler:
    """The launcher's scaling: `handle` on the control API's threads, `step` on the main loop's."""

    def __init__(self, launcher: Any, specs: list[topology.ServiceSpec], probe) -> None:
        self.launcher = launcher  # its supervisor, deployment, bus and settings are the main loop's
        self.probe = probe  # (url) -> (HTTP status or None, body): the gateway's /ready
        self.requests: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.desired = desired_pools(launcher.options)
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
        self._pipelines = topology.pipelines_of(specs)
        self._plans: dict[tuple, list[topology.ServiceSpec]] = {}
        self._view: dict = {}
        # workers switched to the other pool: name -> (its role now, the pid that switched; a restart undoes it)
        self.switched: dict[str, tuple[str, int | None]] = {}
        from services.launcher.switcher import Switches  # (it imports the NATS client)

        self.switches = Switches(self)
        # the instances the NATS config lets in, as last written
        self._admitted = frozenset(c.instance_id for c in launcher.supervisor.children if c.role in ROLES)

    # -- the control API's side -------------------------------------------------

    def handle(self, method: str, route: str, body: object) -> tuple[int, dict]:
        if route == "/v1/deployment" and method == "GET":
            return 200, self.view()
        if route == "/v1/scale" and method == "POST":
            return self.submit(lambda: self._apply(body) if isinstance(body, dict) else
                               (400, {"error": 'the body is {"ROLE": N, ...}'}))
        if route == "/v1/switch" and method == "POST":
            return self.switches.handle(body)
        return 404, {"error": f"no {method} {route} (GET /v1/deployment, POST /v1/scale, POST /v1/switch)"}

    def view(self) -> dict:
        """What the main loop last published, with the gateway's ready counts now, and whether it has settled."""
        view = dict(self._view)
        status, said = self.probe(view["ready_url"]) if view else (None, "")
        try:
            ready = json.loads(said).get("ready", {}) if status is not None else {}
        except (ValueError, AttributeError):
            ready = {}
        view["ready"] = ready
        view["settled"] = bool(view) and not view["retiring"] and not view.get("cpu_handover") and all(
            view["actual"].get(role) == n and ready.get(role, 0) >= n for role, n in view["desired"].items())
        return view

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
        o = self.launcher.options
        try:
            counts = check_scale(body, o.topology, o.prefill_stages is not None)
            self._check_external_credentials(counts)
        except ScaleError as exc:
            return 400, {"error": str(exc)}
        before = dict(self.desired)
        self.desired.update(counts)
        busy = self.handover is not None
        started, retired = self.reconcile()
        after = " (once the CPU handover under way is done)" if busy else ""
        self.launcher.say(f"scale {', '.join(f'{r}={n}' for r, n in counts.items())} (was "
                          f"{', '.join(f'{r}={n}' for r, n in before.items())}): starting {started or 'none'}, "
                          f"retiring {retired or 'none'}{after}")
        return 200, {"desired": dict(self.desired), "starting": started, "retiring": retired}

    def roles_now(self) -> dict[str, str]:
        """Every scalable worker (running or retiring) and the role it serves as now."""
        return {c.name: self.switched.get(c.name, (c.role, None))[0]
                for c in self.launcher.supervisor.children if c.role in SCALABLE}

    def apply_switch(self, name: str, to: str, pid: int | None) -> tuple[int, dict]:
        """(main loop) Worker `name` (process `pid`) serves as `to` now: counted in that pool from now on."""
        before = self.roles_now().get(name)
        if before is None:
            return 409, {"error": f"{name} switched, but is gone from the deployment meanwhile"}
        self.switched[name] = (to, pid)
        if before != to:
            for role, change in ((before, -1), (to, 1)):
                if role in self.desired:
                    self.desired[role] = max(1, self.desired[role] + change)
        self.launcher.say(f"switched {name} from {before} to {to}: desired "
                          f"{', '.join(f'{r}={n}' for r, n in self.desired.items())}")
        self._publish()
        return 200, {"desired": dict(self.desired)}

    def _forget_restarted(self) -> None:
        """A switched worker that restarted runs in its planned role again: the reconcile evens the pools out."""
        pids = {c.name: c.pid for c in self.launcher.supervisor.children}
        for name, (role, pid) in list(self.switched.items()):
            if pids.get(name, -1) != pid:
                del self.switched[name]
                if name in pids:
                    self.launcher.say(f"warning: {name} restarted in its planned role (it served as {role})")

    def _check_external_credentials(self, counts: dict[str, int]) -> None:
        """A --nats server's instances need their credentials in --nats-creds-dir before they can start."""
        creds_dir = self.launcher.options.nats_creds_dir
        if creds_dir is None:
            return
        planned = self._planned({**self.desired, **counts})
        missing = [s.instance_id for s in planned if not creds_path(creds_dir, s.instance_id).is_file()]
        if missing:
            raise ScaleError(f"--nats-creds-dir {creds_dir} lacks the credentials of: {', '.join(missing)} "
                             "(`splitserve nats-auth DIR --instance ROLE:ID ...` writes them)")

    def _planned(self, desired: dict[str, int]) -> list[topology.ServiceSpec]:
        """The scalable pools' instances for `desired` (planned once per set of counts)."""
        key = tuple(sorted(desired.items()))
        if key not in self._plans:
            up = self.launcher.options.model_copy(update=desired)
            self._plans[key] = [s for s in topology.plan(up, self.launcher.resolved) if s.role in SCALABLE]
        return self._plans[key]

    def reconcile(self) -> tuple[list[str], list[str]]:
        """Start what is planned and not running, retire what runs and is not planned; (started, retired)."""
        sup = self.launcher.supervisor
        if not self.desired:  # nothing here scales
            return [], []
        if self.handover is not None:  # one handover at a time: what changed meanwhile is reconciled after it
            self._advance_handover()
            if self.handover is not None:
                self._publish()
                return [], []
        pool = {c.name: c for c in sup.children if c.role in SCALABLE}
        # Planned for more workers than run: names enough for every pool past the workers switched out of it.
        specs = {s.name: s for s in self._planned({r: n + len(pool) for r, n in self.desired.items()})}
        plan = {role: [n for n, s in specs.items() if s.role == role] for role in self.desired}
        planned = {n: specs.get(n) for n in planned_names(self.desired, plan, self.roles_now())}
        retiring = [n for n, c in pool.items() if c.state.value == "stopping"]
        start, retire = reconcile(list(planned), [n for n in pool if n not in retiring], retiring)
        if (start or retire) and self._begin_handover(list(specs), {n: planned[n] for n in start}, retire):
            self._admit([planned[n] for n in start])
            self._advance_handover()
            self._publish()
            return start, retire
        for name in retire:
            sup.retire(name, self.launcher.retire_timeout_s)
        self._admit([planned[n] for n in start])
        self._start([planned[n] for n in start])
        self._publish()
        return start, retire

    # -- moving the running workers to a new share of the CPUs (services.launcher.cpu_handover) ------------

    def _begin_handover(self, order: list[str], start: dict[str, topology.ServiceSpec], retire: list[str]) -> bool:
        """A handover to the share `up` would give the workers that will run (False: none; start and retire as
        without one). `order`: the plan's order of the names."""
        cpus = self.launcher.resolved.cpus
        if not cpus:
            return False
        children = {c.name: c for c in self.launcher.supervisor.children}
        old = {n: held for n, held in self.placements.items() if n in children}
        unmovable = sorted(n for n in old if n not in self.cpus_files)
        stay = [n for n, c in children.items() if c.role in SCALABLE and c.state.value != "stopping"
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
            self._start(unstarted)
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

    def _admit(self, new: list[topology.ServiceSpec]) -> None:
        """The embedded NATS server's config names every instance that runs or is about to (with --nats-auth):
        rewritten and reloaded when that changed, and waited for when some are about to start."""
        launcher = self.launcher
        creds_dir = launcher.resolved.nats_creds_dir
        if launcher.nats is None or not launcher.options.nats_auth or creds_dir is None:
            return
        instances = [Instance(c.role, c.instance_id) for c in launcher.supervisor.children if c.role in ROLES]
        gone = self._admitted - {i.instance_id for i in instances}
        instances += [Instance(s.role, s.instance_id) for s in new]
        names = frozenset(i.instance_id for i in instances)
        if names == self._admitted and not gone:
            return
        for name in gone:  # revoked: a later instance of the name gets a new key
            creds_path(creds_dir, name).unlink(missing_ok=True)
        keys = ensure_credentials(creds_dir, instances)
        keys[ADMIN_INSTANCE] = public_key(launcher.admin.nkey_seed.encode())
        tls = launcher.tls
        write_server_config(launcher.run_dir / "nats.conf", keys, launcher.options.namespace,
                            (tls.cert, tls.key) if tls is not None else None, self._pipelines,
                            launcher.options.role_switch)
        launcher.nats.reload()
        self._admitted = names
        if new:
            self._wait_admitted(creds_path(creds_dir, new[0].instance_id))

    def _wait_admitted(self, creds_file) -> None:
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        run = self.launcher.resolved
        while not admits(run.nats_url, creds_file, run.nats_tls_ca):
            if time.monotonic() >= deadline:
                self.launcher.say(f"warning: the NATS server did not admit the new instances within "
                                  f"{ADMIT_TIMEOUT_S:g} s; starting them anyway")
                return
            time.sleep(0.1)

    def _start(self, new: list[topology.ServiceSpec]) -> None:
        """New workers on CPUs the running ones do not use (where there are enough), lending and borrowing none."""
        cpus = place_new_workers(self.placements, [s.name for s in new], self.launcher.resolved.cpus)
        for spec in new:
            settings = spec.settings.model_copy(update={"cpus": cpus.get(spec.name), "cpu_loan": None,
                                                        **({"borrow_cpus": None} if spec.role == "decode" else {})})
            try:
                self.launcher.start_service(dataclasses.replace(spec, settings=settings))
            except SupervisorError as exc:  # the rest of the deployment serves on
                self.launcher.say(f"warning: {exc}")
                continue
            if spec.name in cpus:
                self.placements[spec.name] = cpus[spec.name]
                if getattr(spec.settings, "cpus_file", None):  # it follows its file: a later scale may move it
                    self.cpus_files[spec.name], self.generations[spec.name] = spec.settings.cpus_file, 0

    def _publish(self) -> None:
        """The view the control API serves, and deployment.json's records of the pools."""
        launcher = self.launcher
        children = {c.name: c for c in launcher.supervisor.children}
        dep = launcher.deployment
        dep.services = [rec for rec in dep.services if rec.name in children]
        self.placements = {n: cpus for n, cpus in self.placements.items() if n in children}
        dep.desired = dict(self.desired)
        roles = self.roles_now()
        for rec in dep.services:  # `splitserve ps` shows each worker in the pool it serves now, on its CPUs
            rec.role = roles.get(rec.name, rec.role)
            if rec.name in self.placements:
                rec.cpus = format_cpu_list(self.placements[rec.name])
        handover = self.handover
        retiring = [c.name for c in children.values() if c.role in SCALABLE and c.state.value == "stopping"]
        self._view = {"state": dep.state, "desired": dict(self.desired), "actual": pool_sizes(roles, retiring),
                      "retiring": retiring, "ready_url": (dep.gateway_url or "") + "/ready",
                      "role_switch": bool(launcher.options.role_switch),
                      "cpu_handover": None if handover is None else {
                          "round": handover.round + 1, "rounds": len(handover.rounds),
                          "awaiting": sorted(handover.awaiting)},
                      "services": {n: {"role": roles[n], "state": c.state.value, "pid": c.pid,
                                       **({"cpus": format_cpu_list(self.placements[n])} if n in self.placements
                                          else {}),
                                       **({"planned_role": c.role} if roles[n] != c.role else {})}
                                   for n, c in children.items() if c.role in SCALABLE}}

