"""`splitserve up`: one deployment on this machine, supervised until stopped.

Order of things: own the run directory (lock) -> check the port -> resolve
the model -> embedded NATS (unless a URL was given) -> scheduler, workers,
gateway under the `Supervisor` -> poll the gateway's `/ready` until every
service is ready ->
print one ready line on stdout -> supervise until SIGINT/SIGTERM/SIGHUP ->
stop the services (SIGTERM, then SIGKILL), then NATS, within the stop
timeout. Everything else goes to stderr.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from services.common.cpu_placement import Placement, ack_path, write_placement
from services.common.cpus import format_cpu_list, worker_cpus
from services.common.settings import secret_env
from services.gateway.readiness import fully_ready, missing
from services.launcher.admin_bus import ready_in_registry
from services.launcher import topology, trace_viewer
from services.launcher.deployment import (
    DEGRADED,
    FAILED,
    MODEL_SERVING,
    MODEL_STARTING,
    RUN_DIR_ENV,
    READY,
    STARTING,
    STOPPED,
    STOPPING,
    Deployment,
    DeploymentError,
    ModelRecord,
    NatsNode,
    NatsRecord,
    RunDirBusy,
    RunDirLock,
    ServiceRecord,
    leftover_processes,
    now_iso,
    read_deployment,
    write_deployment,
)
from services.launcher.bus_start import external_bus, start_embedded_bus
from services.launcher.launch_checks import LaunchError, check_port_free, check_settings, probe_health, resolve_model
from services.launcher.nats_server import EmbeddedNats, EmbeddedNatsCluster, NatsServerError, wait_for_nats
from services.launcher.procs import describe_exit, process_start_time
from services.launcher.service_spawner import ServiceSpawner, same_interpreter
from services.launcher.supervisor import (
    RestartPolicy,
    Supervisor,
    SupervisorError,
    SupervisorEvent,
    should_give_up,
)
from services.launcher.tls_files import TLSFiles
from services.launcher.up_settings import UpSettings
from services.launcher.model_spec import ModelSpec, check_served_names
from services.launcher.served_models import FurtherModel, further_model, pipeline_split, pipelined
from services.launcher.provision import provision
from services.launcher.resolved_run import ResolvedRun
from services.launcher.control_socket import ControlServer, socket_path
from services.launcher.planner_spec import default_budget, planner_spec
from services.launcher.scale_policy import desired_pools
from services.launcher.scaler import Scaler
from shared.bus.credentials import BusCredentials
from shared.bus.provision import replicas_for
from shared.private_files import private_dir

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PLANNER_START_S = 30.0  # a planner imports little: past this it is reported, and the deployment serves on


def _tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


class Launcher:
    """Runs one deployment until asked to stop. `run()` returns the exit code.

    `request_stop()` is safe to call from a signal handler (it only sets a
    flag; the loops look at it every 0.1 s).
    """

    def __init__(
        self,
        options: UpSettings,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        policy: RestartPolicy | None = None,
        python: str | None = None,
        poll_interval_s: float = 0.25,
    ) -> None:
        self.options = options
        self.run_dir = Path(options.run_dir)
        self.log_dir = self.run_dir / "logs"
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.policy = policy or RestartPolicy()
        self.python = python or sys.executable
        self.poll_interval_s = poll_interval_s
        self._stop_requested = False
        self._stage_ranges: tuple[tuple[int, int], ...] = ()
        self._phoenix: str | None = None  # the trace viewer's command, with --trace-viewer
        self.nats: EmbeddedNatsCluster | None = None
        self.supervisor: Supervisor | None = None
        # A forkserver only where the services will be its forks (another --python's never are); a fork of this
        # process where it has the forkserver's imports already.
        self.spawner = ServiceSpawner(enabled=options.fork_services and same_interpreter(self.python),
                                      fork_if_preloaded=True)
        self.deployment: Deployment | None = None
        self._nats_restart_times: dict[str, list[float]] = {}  # per node
        self._snapshot: object = None
        self._admin: BusCredentials | None = None  # the provisioner's key (with the embedded server: only here)
        self.resolved: ResolvedRun | None = None  # what the services were planned from (the bus's URL included)
        self.tls: TLSFiles | None = None  # the embedded server's, with --tls
        self.scaler: Scaler | None = None  # scales the pools, once the deployment is ready
        self.control: ControlServer | None = None  # the control API, on RUN_DIR/control.sock
        self._specs: list[topology.ServiceSpec] = []
        self.further: tuple[FurtherModel, ...] = ()  # the models served beside the first, as `up` started them
        self.planned: dict[str, topology.ServiceSpec] = {}  # every service started, by name, as planned

    # -- control ----------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop_requested:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    def _say(self, text: str) -> None:
        print(f"splitserve up: {text}", file=self.err, flush=True)

    say = _say

    @property
    def admin(self) -> BusCredentials | None:
        return self._admin

    @property
    def retire_timeout_s(self) -> float:
        """How long a retired worker may take to drain and exit before SIGKILL: a stopping service's."""
        return stop_budgets(self.options.stop_timeout_s)[0]

    # -- the run ----------------------------------------------------------------

    def run(self) -> int:
        try:
            check_settings(self.options)
            lock = RunDirLock(self.run_dir)
            try:
                lock.acquire()
            except RunDirBusy as exc:
                raise LaunchError(str(exc), 2) from None
        except LaunchError as exc:
            self._say(f"error: {exc}")
            return exc.exit_code
        try:
            return self._run_locked()
        finally:
            lock.release()

    def _run_locked(self) -> int:
        o = self.options
        failure: LaunchError | None = None
        try:
            self._check_leftovers()
            check_port_free(o.host, o.port)
            if o.trace_viewer:
                try:
                    self._phoenix = trace_viewer.find_phoenix()
                except trace_viewer.TraceViewerError as exc:
                    raise LaunchError(str(exc), 2) from None
                check_port_free("127.0.0.1", o.trace_viewer_port)
                check_port_free("127.0.0.1", o.trace_viewer_port + 1)
            if o.nats is not None and not wait_for_nats(o.nats, timeout_s=o.nats_connect_timeout_s):
                raise LaunchError(f"cannot reach a NATS server at {o.nats}", 2)
            self._say(f"starting in {self.run_dir} (logs in {self.log_dir})")
            model_dir, served_name = resolve_model(o.first_model, o.served_model_name, self._say)
            self._stage_ranges = self._pipeline_split(o, model_dir) if pipelined(o) else ()
            served = [served_name]  # each model served under a name of its own
            self.further = tuple(self.prepare_model(spec, index, served)
                                 for index, spec in enumerate(o.further_models, start=1))
            if self._stop_requested:
                return 0
            self._start(model_dir, served_name)
            if not self._wait_ready():
                return 0  # asked to stop while starting
            self._print_ready(served_name)
            self._supervise()
            return 0
        except LaunchError as exc:
            failure = exc
        except (NatsServerError, SupervisorError) as exc:
            failure = LaunchError(str(exc), 1)
        finally:
            if failure is not None:
                self._say(f"error: {failure}")
            self._shutdown(failure)
        return failure.exit_code

    def _provision(self, nats_url: str, tls_ca: str | None, replicas: int | None) -> None:
        """The deployment's streams and registry, made with the admin key before any service starts (with none
        on an open bus). Without one (a --nats server whose DIR holds no admin.nk) the operator provisions:
        the services wait for it."""
        if self._admin is None and self.options.nats_creds_dir is not None:
            self._say("no admin.nk in --nats-creds-dir: the services wait for `splitserve provision` to make the "
                      "deployment's streams")
            return
        from shared.telemetry.logging import configure_logging

        configure_logging("launcher", "provision", "warning")  # to stderr: the launcher's own output is its stdout
        for namespace in (self.options.namespace, *(m.namespace for m in self.further)):
            self.provision_namespace(namespace, nats_url, tls_ca, replicas)

    def provision_namespace(self, namespace: str, nats_url: str | None = None, tls_ca: str | None = None,
                            replicas: int | None = None) -> None:
        """One model's namespace's streams and registry (the running bus's, unless given); LaunchError if the
        server does not answer or refuses."""
        run = self.resolved
        if nats_url is None and run is not None:
            nats_url, tls_ca, replicas = run.nats_url, run.nats_tls_ca, run.nats_replicas
        try:
            provision(nats_url, namespace, self._admin, tls_ca, replicas)
        except Exception as exc:  # an unreachable or refusing server: nothing of it can start
            raise LaunchError(f"could not provision the streams of namespace {namespace}: {exc}", 1) from None

    @staticmethod
    def _pipeline_split(o: UpSettings, model_dir: str) -> tuple[tuple[int, int], ...]:
        """The pipeline's layer ranges, checked against the model before anything starts (exit 2 if bad)."""
        try:
            return pipeline_split(o, model_dir)
        except ValueError as exc:
            raise LaunchError(str(exc), 2) from None

    def prepare_model(self, spec: ModelSpec, index: int, served: list[str]) -> FurtherModel:
        """The `index`-th further model, its model resolved (fetched or converted where needed) and checked, its
        served name none of `served` (extended with it); LaunchError (exit 2 where the spec is at fault)."""
        model_dir, served_name = resolve_model(spec.model, spec.name, self._say)
        try:
            check_served_names([*served, served_name])
            model = further_model(self.options, spec, index, model_dir, served_name)
        except ValueError as exc:
            raise LaunchError(str(exc), 2) from None
        served.append(served_name)
        return model

    def _check_leftovers(self) -> None:
        try:
            previous = read_deployment(self.run_dir)
        except DeploymentError:
            return
        if previous is None:
            return
        left = leftover_processes(previous)
        if left:
            listed = ", ".join(f"{name} (pid {pid})" for name, pid in left)
            raise LaunchError(
                f"processes of an earlier deployment in {self.run_dir} are still running: {listed}; stop them first", 2
            )

    def _resolved_run(self, model_dir: str, served_name: str) -> ResolvedRun:
        """What the topology plans from beside the settings (the bus's URL, credentials and TLS filled in once NATS
        is up)."""
        o = self.options
        return ResolvedRun(
            model_dir=model_dir, served_model_name=served_name, nats_url="", cpus=worker_cpus(o.cpus),
            drain_timeout=stop_budgets(o.stop_timeout_s)[2], stage_ranges=self._stage_ranges,
            # A file is named by its absolute path: the gateway need not share this process's working directory.
            chat_template=os.path.abspath(o.chat_template) if o.chat_template and os.path.isfile(o.chat_template)
            else o.chat_template,
            # The cluster started here has a known size: every service is told the copies, rather than each going by
            # the nodes it saw on connecting (fewer, while the routes were forming).
            nats_replicas=replicas_for(o.nats_replicas, o.nats_cluster) if o.nats is None and o.nats_cluster > 1
            else o.nats_replicas,
            cpu_loan_dir=str(self.run_dir / "cpu-loans") if o.lend_idle_cpus else None,
            cpu_placement_dir=str(self.run_dir / "cpus"),
            kv_store_dir=str(self.run_dir / "kvstore") if o.kv_store_disk_bytes else None,
        )

    def _child_env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH")
        return {
            "PYTHONUNBUFFERED": "1",
            # Services import from the same tree as the launcher, installed or not.
            "PYTHONPATH": str(PROJECT_ROOT) + (os.pathsep + path if path else ""),
            # The gateway's /health names the services this launcher marked failed, from deployment.json.
            RUN_DIR_ENV: str(self.run_dir.absolute()),
        }

    def _start(self, model_dir: str, served_name: str) -> None:
        """Record the deployment, start its bus, then every planned service under the supervisor."""
        self.spawner.start()  # its imports while the bus starts
        self._fresh_log_dir()
        self._begin_deployment(model_dir, served_name)
        run = self._resolved_run(model_dir, served_name)
        run = self._start_bus(run, topology.plan(self.options, run, self.further))
        self.resolved = run
        self._provision(run.nats_url, run.nats_tls_ca, run.nats_replicas)
        self._specs = topology.plan(self.options, run, self.further)
        self._start_services(self._specs)

    def _fresh_log_dir(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ignore = self.run_dir / ".gitignore"  # a run dir inside a checkout stays out of `git status`
        if not ignore.exists():
            ignore.write_text("# written by splitserve up: nothing in the run directory belongs in git\n*\n")
        for old in self.log_dir.glob("*.log"):  # logs are per deployment
            old.unlink(missing_ok=True)

    def _begin_deployment(self, model_dir: str, served_name: str) -> None:
        o = self.options
        gateway_url = topology.http_url(o.host, o.port)
        self.deployment = Deployment(
            run_dir=str(self.run_dir),
            namespace=o.namespace,
            topology=o.topology,
            model=model_dir,
            served_model_name=served_name,
            gateway_url=gateway_url,
            api_url=gateway_url + "/v1",
            state=STARTING,
            launcher_pid=os.getpid(),
            launcher_start_time=process_start_time(os.getpid()),
            started_at=now_iso(),
            desired=desired_pools(o),
            models=[ModelRecord(served_name, o.namespace, model_dir, state=MODEL_STARTING, desired=desired_pools(o)),
                    *(ModelRecord(m.served_name, m.namespace, m.model_dir, m.prefix, MODEL_STARTING,
                                  desired_pools(m.up)) for m in self.further)],
        )
        write_deployment(self.run_dir, self.deployment)

    def _start_bus(self, run: ResolvedRun, planned: list[topology.ServiceSpec]) -> ResolvedRun:
        """The embedded NATS (or the --nats server's credentials checked); `run` with the bus's URL, credentials
        and TLS."""
        if self.options.nats is None:
            bus = start_embedded_bus(self.options, self.run_dir, self.log_dir, planned)
        else:
            bus = external_bus(self.options, planned)
        self.nats, self.tls, self._admin = bus.nats, bus.tls, bus.admin
        creds_dir = str(bus.creds_dir) if bus.creds_dir else None
        assert self.deployment is not None
        self.deployment.nats = NatsRecord(url=bus.url, embedded=bus.nats is not None, creds_dir=creds_dir)
        return dataclasses.replace(run, nats_url=bus.url, nats_creds_dir=creds_dir, nats_tls_ca=bus.tls_ca,
                                   transfer_tls=bus.transfer_tls)

    def _start_services(self, specs: list[topology.ServiceSpec]) -> None:
        """Every planned service (and the trace viewer) under the supervisor, recorded in deployment.json."""
        o = self.options
        assert self.deployment is not None
        self.supervisor = Supervisor(self.log_dir, self.policy, log_max_bytes=o.log_max_bytes,
                                     log_backups=o.log_backups, spawner=self.spawner)
        if o.trace_viewer:
            port = o.trace_viewer_port
            self.supervisor.add("trace-viewer", trace_viewer.viewer_command(self._phoenix), role="trace-viewer",
                                instance_id="trace-viewer",
                                env={**self._child_env(),
                                     **trace_viewer.viewer_env(self.run_dir / "trace-viewer", port, port + 1)})
        self.deployment.services = []
        for spec in specs:
            self._add_service(spec)
        if o.trace_viewer:
            self.deployment.services.insert(0, ServiceRecord(
                name="trace-viewer", role="trace-viewer", instance_id="trace-viewer",
                argv=trace_viewer.viewer_command(self._phoenix), log=str(self.log_dir / "trace-viewer.log"),
                url=f"http://127.0.0.1:{o.trace_viewer_port}"))
        self.supervisor.start()
        self._record(force=True)

    def _add_service(self, spec: topology.ServiceSpec) -> None:
        """One planned service under the supervisor (not started yet), recorded in the deployment."""
        assert self.supervisor is not None and self.deployment is not None
        env = self._child_env()
        if self.options.trace_viewer:
            env |= trace_viewer.exporter_env(self.options.trace_viewer_port)
        write_first_placement(spec.settings)
        # A secret (the gateway's API keys) goes by its variable, never on a command line.
        self.supervisor.add(spec.name, spec.argv(self.python), env={**env, **secret_env(spec.settings)},
                            role=spec.role, instance_id=spec.instance_id)
        self.planned[spec.name] = spec
        served = {m.namespace: m.name for m in self.deployment.models}
        self.deployment.services.append(ServiceRecord(
            name=spec.name, role=spec.role, instance_id=spec.instance_id, argv=spec.argv(self.python),
            log=str(self.log_dir / f"{spec.name}.log"), url=spec.url,
            cpus=format_cpu_list(spec.settings.cpus) if getattr(spec.settings, "cpus", None) else None,
            model=served.get(getattr(spec.settings, "namespace", None)) if spec.role != "gateway" else None))

    def start_service(self, spec: topology.ServiceSpec) -> None:
        """A service added to the running deployment (a scale), started now."""
        assert self.supervisor is not None
        self._add_service(spec)
        self.supervisor.start(spec.name)

    def _open_control(self) -> None:
        """The control API (`splitserve scale`, `GET /v1/deployment`) on its socket, recorded in deployment.json."""
        assert self.supervisor is not None and self.deployment is not None
        self.scaler = Scaler(self, self._specs, probe_health)
        self.scaler.step()
        try:
            self.control = ControlServer(socket_path(self.run_dir), self.scaler.handle).start()
        except OSError as exc:
            self._say(f"warning: no control API ({exc}); `splitserve scale` cannot reach this deployment")
            return
        self.deployment.control_socket = str(self.control.path)
        self._record(force=True)

    def _start_planner(self) -> None:
        """With --planner slo, the SLO planner, once the control API it scales through is open."""
        o = self.options
        if o.planner == "none":
            return
        if self.control is None or self.deployment is None or not self.deployment.gateway_url:
            self._say("warning: no control API, so no SLO planner")
            return
        from services.common.free_port import free_port

        assert self.resolved is not None
        budget = o.planner_budget or default_budget(o, self.resolved.cpus, os.cpu_count() or 1)
        spec = planner_spec(o, self.deployment.gateway_url, str(self.control.path), budget, free_port(),
                            self.resolved.served_model_name)
        try:
            self.start_service(spec)
        except SupervisorError as exc:  # the deployment serves on, unplanned
            self._say(f"warning: the SLO planner did not start: {exc}")
            return
        if not self._answers(spec.url, PLANNER_START_S):  # serves on unplanned, said so; the supervisor retries
            self._say(f"warning: the SLO planner's metrics ({spec.url}) did not answer within {PLANNER_START_S:g} s")
        self._say(f"SLO planner: ttft p90 {o.ttft_slo_ms:g} ms, itl p90 {o.itl_slo_ms:g} ms, budget {budget} workers"
                  + (", dry run" if o.planner_dry_run else "") + f"; its metrics: {spec.url}")

    def _answers(self, url: str, timeout_s: float) -> bool:
        """Whether `url` answers 200 within `timeout_s` (the supervisor kept stepping meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while not self._stop_requested and time.monotonic() < deadline:
            self._step(starting=True)
            if probe_health(url, timeout_s=1.0)[0] == 200:
                return True
            self._sleep(self.poll_interval_s)
        return False

    def _record(self, force: bool = False) -> None:
        """Copy live state into deployment.json when it changed."""
        dep = self.deployment
        if dep is None:
            return
        if self.supervisor is not None:
            for rec in dep.services:
                child = self.supervisor.child(rec.name)
                rec.pid, rec.start_time = child.pid, child.start_time
                rec.restarts, rec.state, rec.exit_code = child.restarts, child.state.value, child.exit_code
        if self.nats is not None and dep.nats is not None:
            first, *others = self.nats.nodes
            dep.nats.pid, dep.nats.start_time = first.pid, first.start_time
            dep.nats.restarts, dep.nats.log = first.restarts, str(first.log_path)
            dep.nats.nodes = [NatsNode(name=n.server_name, url=n.url, pid=n.pid, start_time=n.start_time,
                                       restarts=n.restarts, log=str(n.log_path)) for n in others]
        snapshot = (dep.state, dep.message, repr(dep.nats), [repr(s) for s in dep.services], repr(dep.desired),
                    dep.control_socket, repr(dep.models))
        if force or snapshot != self._snapshot:
            self._snapshot = snapshot
            try:
                write_deployment(self.run_dir, dep)
            except OSError as exc:  # a full disk must not take the deployment down
                self._say(f"warning: cannot write {self.run_dir / 'deployment.json'}: {exc}")

    def _step(self, starting: bool = False) -> None:
        """One round of supervision: services, then the embedded NATS. While `starting`, a service that keeps
        failing fails the launch (most likely a wrong flag); once serving, it is marked failed, tried again now
        and then, and the rest keep serving."""
        assert self.supervisor is not None
        for event in self.supervisor.poll():
            if event.kind == "gave_up" and starting:
                raise LaunchError(self._failing_message(self.supervisor.child(event.name)), 1)
            self._report(event)
        if self.scaler is not None:
            self.scaler.step()
        if self.deployment is not None and self.deployment.state in (READY, DEGRADED):
            self.deployment.state = DEGRADED if self.supervisor.failed() else READY
        if self.nats is not None:
            for node in self.nats.exited():
                self._restart_nats(node)
        self._record()

    def _failing_message(self, child) -> str:
        lines = [f"{child.name} keeps failing ({describe_exit(child.exit_code)} after {child.restarts} restarts); "
                 f"see {child.log_path}"]
        tail = _tail(child.log_path)
        if tail:
            lines.append(f"last lines of {child.log_path.name}:")
            lines += ["    " + line for line in tail]
        return "\n".join(lines)

    def _report(self, event: SupervisorEvent) -> None:
        assert self.supervisor is not None
        if event.kind == "retired":  # scaled away: gone from the supervisor
            self._say(event.message)
            return
        child = self.supervisor.child(event.name)
        if event.kind == "exited":
            self._say(f"{event.message} (log: {child.log_path})")
        elif event.kind == "restarted":
            self._say(event.message)
        elif event.kind == "gave_up":
            self._say(f"{event.message}; the other services keep serving\n" + self._failing_message(child))

    def _restart_nats(self, node: EmbeddedNats) -> None:
        now = time.monotonic()
        how = describe_exit(node.poll())
        times = self._nats_restart_times.setdefault(node.server_name, [])
        server = "the embedded NATS server" + (f" {node.server_name}" if node.cluster is not None else "")
        if should_give_up(times, now, self.policy):
            raise LaunchError(f"{server} {how} and keeps failing; see {node.log_path}", 1)
        times.append(now)
        self._say(f"{server} {how}; restarting it on the same port")
        node.start()

    def _wait_ready(self) -> bool:
        """Poll the gateway's /ready until every service is (and the trace viewer answers); False if asked to stop
        first."""
        o = self.options
        assert self.deployment is not None and self.deployment.gateway_url
        url = self.deployment.gateway_url + "/ready"
        viewer = f"http://127.0.0.1:{o.trace_viewer_port}/" if o.trace_viewer else None
        deadline = time.monotonic() + o.ready_timeout_s
        status, said = None, "no answer yet"
        while not self._stop_requested:
            self._step(starting=True)
            status, said = probe_health(url, timeout_s=min(2.0, max(o.ready_timeout_s, 0.1)))
            ready = fully_ready(status, said)
            if ready and viewer is not None and probe_health(viewer, timeout_s=2.0)[0] != 200:
                ready, status, said = False, None, f"the trace viewer ({viewer}) is not up yet"
            lacking = self._further_lacking() if ready else None
            if lacking:
                ready, status, said = False, None, lacking
            if ready:
                return True
            if time.monotonic() >= deadline:
                raise LaunchError(self._not_ready_message(url, status, said), 1)
            self._sleep(self.poll_interval_s)
        return False

    def reads_registries(self) -> bool:
        """Whether this launcher may read the registries: with the admin key, or on an open bus."""
        return self._admin is not None or (self.resolved is not None and self.resolved.nats_creds_dir is None)

    def _further_lacking(self) -> str | None:
        """What the further models' registries (which the gateway's /ready does not judge) lack of their services
        ready; None once none lacks any (or where this launcher may not read them: a --nats server's credentials
        without admin.nk)."""
        run = self.resolved
        if not self.further or run is None or not self.reads_registries():
            return None
        for model in self.further:
            try:
                counts = ready_in_registry(run.nats_url, model.namespace, self._admin, run.nats_tls_ca)
            except Exception as exc:  # the bus busy or restarting: asked again next round
                return f"the registry of {model.namespace} did not answer ({type(exc).__name__}: {exc})"
            short = missing(counts, topology.expected_counts(model.up, topology.run_of(run, model)))
            if short:
                return (f"model {model.served_name} (namespace {model.namespace}) has no ready "
                        + ", ".join(f"{role} ({n} more)" for role, n in short.items()))
        return None

    def _not_ready_message(self, url: str, status: int | None, said: str) -> str:
        o = self.options
        answer = f"{status} {said.strip()}" if status is not None else f"no answer ({said})"
        lines = [f"the deployment was not ready within {o.ready_timeout_s:g} s (GET {url}: {answer}); the logs:"]
        assert self.supervisor is not None
        for child in self.supervisor.children:
            note = child.state.value
            if child.restarts:
                note += f", {child.restarts} restarts, last {describe_exit(child.exit_code)}"
            lines.append(f"  {child.name:<14} {note:<40} {child.log_path}")
        for node in self.nats.nodes if self.nats is not None else ():
            name = "nats" if len(self.nats.nodes) == 1 else node.server_name
            lines.append(f"  {name:<14} {'running' if node.running else 'exited':<40} {node.log_path}")
        return "\n".join(lines)

    def _print_ready(self, served_name: str) -> None:
        o = self.options
        assert self.deployment is not None
        self.deployment.state = READY
        for model in self.deployment.models:
            model.state = MODEL_SERVING
        self._open_control()  # before the ready line: whoever reads it may scale at once
        self._start_planner()
        self._record(force=True)
        workers = f"{o.decode} decode worker" + ("" if o.decode == 1 else "s")
        if o.topology == "disagg" and self._stage_ranges:
            workers = (f"a prefill pipeline of {len(self._stage_ranges)} stages: "
                       + ", ".join(f"{a}:{b}" for a, b in self._stage_ranges) + "; " + workers)
        elif o.topology == "disagg":
            workers = f"{o.prefill} prefill worker" + ("" if o.prefill == 1 else "s") + ", " + workers
        elif o.topology == "pipeline":
            workers = (("a pipeline" if o.decode == 1 else f"{o.decode} pipelines") + f" of {len(self._stage_ranges)} "
                       "stages: " + ", ".join(f"{a}:{b}" for a, b in self._stage_ranges))
        also = "".join(f"; model {m.served_name}, topology {m.up.topology}, namespace {m.namespace}"
                       for m in self.further)
        try:
            print(
                f"splitserve ready: {self.deployment.api_url} (model {served_name}, topology {o.topology}, {workers}"
                f"{also})",
                file=self.out,
                flush=True,
            )
            if o.trace_viewer:
                print(f"splitserve traces: http://127.0.0.1:{o.trace_viewer_port} (Arize Phoenix)", file=self.out,
                      flush=True)
        except BrokenPipeError:  # `splitserve up | head -1`: nobody reads on; keep serving
            pass

    def _supervise(self) -> None:
        while not self._stop_requested:
            self._step()
            self._sleep(self.poll_interval_s)

    def _shutdown(self, failure: LaunchError | None) -> None:
        """Stop the services, then NATS, within the stop timeout."""
        o = self.options
        dep = self.deployment
        if self.scaler is not None:
            self.scaler.refuse_pending()
        if self.control is not None:
            self.control.close()
            self.control = None
            if dep is not None:
                dep.control_socket = None
        if dep is not None:
            dep.state = STOPPING
            self._record(force=True)
        children_budget, nats_budget, _ = stop_budgets(o.stop_timeout_s)
        if self.supervisor is not None:
            self.supervisor.stop(children_budget)
            for child in self.supervisor.children:
                if child.killed:
                    self._say(f"{child.name} did not stop within {children_budget:g} s and was killed")
        if self.nats is not None:
            self.nats.stop(nats_budget)
        if dep is not None:
            dep.state = FAILED if failure is not None else STOPPED
            dep.message = str(failure).splitlines()[0] if failure is not None else None
            self._record(force=True)


def write_first_placement(settings) -> None:
    """A worker with a placement file (--cpus-file) finds its CPUs there as it starts (generation 0), and no ack of
    an earlier process of its name."""
    path = getattr(settings, "cpus_file", None)
    if not path or not settings.cpus:
        return
    private_dir(Path(path).parent)
    ack_path(path).unlink(missing_ok=True)
    write_placement(path, Placement(0, tuple(settings.cpus), tuple(getattr(settings, "borrow_cpus", None) or ())))


def stop_budgets(stop_timeout_s: float) -> tuple[float, float, float]:
    """How `--stop-timeout` is spent: (services, NATS, the drain the services are told to take).

    Services stop first, then NATS (they drain through it); the supervisor may take up to a second more to see
    orphaned grandchildren gone. A service's drain ends 1.5 s before it would be killed, so it has time to exit.
    """
    nats = min(2.0, stop_timeout_s / 4)
    services = max(stop_timeout_s - nats - 1.5, 0.5)
    return services, nats, max(services - 1.5, 0.0)


def install_signal_handlers(launcher: Launcher) -> dict[int, object]:
    """SIGINT, SIGTERM and SIGHUP ask the launcher to stop. Returns the old handlers."""
    previous = {}

    def handler(signum, frame) -> None:  # noqa: ARG001
        launcher.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    return previous


def restore_signal_handlers(previous: dict[int, object]) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)
