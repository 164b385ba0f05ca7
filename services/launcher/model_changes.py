"""`splitserve models serve|unserve|served` on the launcher's control API: a model served beside the running ones,
or no longer.

Serve (`POST /v1/models {"name": NAME, "model": MODEL, KEY: VALUE, ...}`): on the control API's thread the spec is
checked and its model resolved (fetched or converted where needed); then, on the main loop, its namespace's streams
are provisioned, its services' credentials admitted (the gateway's now spans its namespace too: the NATS config
rewritten and reloaded) and its services started. A follow-up thread waits (within up's --ready-timeout) until its
scheduler and a worker are registered ready in its namespace, then sends `ServeModel` to the gateway from the admin
connection. A model the gateway does not take is undone (its services retired, their credentials revoked) and
listed as failed, with the reason, until it is served again.

Unserve (`DELETE /v1/models/NAME`): the gateway is told first (`ServeModel(serve=False)`: new requests for it get
404, open streams finish); then, on the main loop, its services retire (SIGTERM: they drain); once all are gone
their credentials are revoked, and the gateway's access to its namespace with them. The first model is not
unserved: it is the deployment's.

One change talks to the gateway at a time (`_gateway_lock`): an unserve never crosses a serve's `ServeModel`.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from typing import Any

from contracts import ServeModel
from services.gateway.readiness import missing, needed_to_serve
from services.launcher import topology
from services.launcher.admin_bus import ready_in_registry, send_serve_model
from services.launcher.deployment import MODEL_FAILED, MODEL_SERVING, MODEL_STARTING, MODEL_STOPPING, ModelRecord
from services.launcher.model_spec import ModelSpecError, spec_of
from services.launcher.scale_policy import desired_pools
from services.launcher.served_models import FurtherModel
from shared.bus.permissions import ROLES

GATEWAY_ANSWER_S = 30.0  # the gateway loads the model's tokenizer before it answers
REGISTRY_POLL_S = 0.5
MAX_FAILED = 16  # failed serves remembered (for `served`), the oldest forgotten first


class ModelChanges:
    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.failed: dict[str, str] = {}  # a serve that did not take: why (until it is served again)
        self._gateway_lock = threading.Lock()
        self._changing = threading.Lock()  # checks and the next index, one serve or unserve at a time
        self._next_index = len(scaler.launcher.further) + 1  # never reused: a retiring name stays its own
        self._cancelled: set[str] = set()  # unserved while starting: its follow-up sends nothing

    @property
    def launcher(self):
        return self.scaler.launcher

    def handle(self, method: str, route: str, body: object) -> tuple[int, dict]:
        if route == "/v1/models" and method == "GET":
            return 200, self.listing()
        if route == "/v1/models" and method == "POST":
            return self.serve(body)
        name = urllib.parse.unquote(route.removeprefix("/v1/models/"))
        if route.startswith("/v1/models/") and name and method == "DELETE":
            return self.unserve(name)
        return 404, {"error": f"no {method} {route} (GET|POST /v1/models, DELETE /v1/models/NAME)"}

    # -- the control API's side -------------------------------------------------

    def listing(self) -> dict:
        """Every model served (or starting, or stopping), with its registry's ready services, and the failed."""
        records = [ModelRecord(**vars(m)) for m in list(self.launcher.deployment.models)]
        first = records[0].name if records else None
        models = [{**vars(m), "first": m.name == first,
                   "ready": self._ready(m.namespace) if m.state != MODEL_FAILED else {}} for m in records]
        models += [{"name": name, "state": MODEL_FAILED, "error": error} for name, error in dict(self.failed).items()
                   if name not in {m.name for m in records}]  # (while its services retire, it is listed stopping)
        return {"models": models}

    def _ready(self, namespace: str) -> dict[str, int]:
        launcher = self.launcher
        if not launcher.reads_registries():
            return {}
        run = launcher.resolved
        try:
            return ready_in_registry(run.nats_url, namespace, launcher.admin, run.nats_tls_ca)
        except Exception:  # the bus busy: said as nothing ready
            return {}

    def serve(self, body: object) -> tuple[int, dict]:
        if not isinstance(body, dict) or not all(isinstance(body.get(key), str) for key in ("name", "model")):
            return 400, {"error": 'the body is {"name": NAME, "model": MODEL, KEY: VALUE, ...}'}
        name = body["name"]
        try:
            spec = spec_of(body["model"], {k: v for k, v in body.items() if k != "model"}, f"model {name}")
        except ModelSpecError as exc:
            return 400, {"error": str(exc)}
        if not self.launcher.reads_registries():
            return 409, {"error": "this launcher holds no admin key (a --nats server without admin.nk): only the "
                                  "admin identity may tell the gateway to serve a model"}
        with self._changing:
            served = [m.name for m in self.launcher.deployment.models]
            if name in served:
                return 409, {"error": f"a model is served as {name!r} already (`splitserve models served`)"}
            try:
                model = self.launcher.prepare_model(spec, self._next_index, served)
            except Exception as exc:  # the launcher's error: a bad spec (exit code 2), or the model not fetched
                return (400 if getattr(exc, "exit_code", 1) == 2 else 500), {"error": str(exc)}
            self._next_index += 1
            status, answer = self.scaler.submit(lambda: self._start(model))
        if status == 200:
            threading.Thread(target=self._follow, args=(model,), name=f"serve-{model.prefix}", daemon=True).start()
        return status, answer

    def unserve(self, name: str) -> tuple[int, dict]:
        with self._changing:
            records = {m.name: m for m in self.launcher.deployment.models}
            if records and name == self.launcher.deployment.models[0].name:
                return 409, {"error": "the deployment's first model cannot be unserved; stop the deployment"}
            if name not in records:
                if self.failed.pop(name, None) is not None:
                    return 200, {"name": name, "retiring": [], "forgotten": True}
                return 404, {"error": f"no model is served as {name!r} (`splitserve models served`)"}
            if records[name].state == MODEL_STOPPING:
                return 409, {"error": f"{name} is being unserved already"}
            with self._gateway_lock:
                self._cancelled.add(name)
                try:
                    reply = self._tell_gateway(ServeModel(served_name=name, serve=False))
                except Exception as exc:
                    self._cancelled.discard(name)
                    return 504, {"error": f"the gateway did not answer ({type(exc).__name__}: {exc}); nothing changed"}
                if not reply.ok and reply.code != "unknown_model":  # never taken (still starting): retired alike
                    self._cancelled.discard(name)
                    return 409, {"error": f"the gateway refused to stop serving {name} ({reply.code}): {reply.error}"}
            return self.scaler.submit(lambda: self._retire(name, None))

    def _tell_gateway(self, message: ServeModel):
        launcher = self.launcher
        run = launcher.resolved
        gateway = next(s.instance_id for s in launcher.planned.values() if s.role == "gateway")
        return send_serve_model(run.nats_url, launcher.options.namespace, launcher.admin, run.nats_tls_ca, gateway,
                                message, GATEWAY_ANSWER_S)

    # -- the follow-up thread -----------------------------------------------------

    def _follow(self, model: FurtherModel) -> None:
        """Until the model's scheduler and a worker are registered ready, then the gateway told; undone if not."""
        launcher, name = self.launcher, model.served_name
        needed = needed_to_serve(topology.expected_counts(model.up, topology.run_of(launcher.resolved, model)))
        deadline = time.monotonic() + launcher.options.ready_timeout_s
        while True:
            if launcher.stop_requested or name in self._cancelled:
                return
            short = missing(self._ready(model.namespace), needed)
            if not short:
                break
            if time.monotonic() >= deadline:
                lacking = ", ".join(f"{role} ({n} more)" for role, n in short.items())
                self._fail(name, f"its services were not registered ready in {model.namespace} within "
                                 f"{launcher.options.ready_timeout_s:g} s (no ready {lacking}; see its logs)")
                return
            time.sleep(REGISTRY_POLL_S)
        with self._gateway_lock:
            if name in self._cancelled:
                return
            try:
                reply = self._tell_gateway(ServeModel(served_name=name, serve=True, model=model.model_dir,
                                                      namespace=model.namespace))
            except Exception as exc:
                self._fail(name, f"its services registered ready in {model.namespace}, but the gateway did not "
                                 f"answer ({type(exc).__name__}: {exc})")
                return
            if not reply.ok:
                self._fail(name, f"its services registered ready in {model.namespace}, but the gateway refused it "
                                 f"({reply.code}): {reply.error}")
                return
            self.scaler.submit(lambda: self._served(name))

    def _fail(self, name: str, why: str) -> None:
        self.scaler.submit(lambda: self._retire(name, why))

    # -- the main loop's side -------------------------------------------------------

    def _start(self, model: FurtherModel) -> tuple[int, dict]:
        """Provision its namespace, admit its credentials, start its services."""
        scaler, launcher = self.scaler, self.launcher
        specs = topology.model_services(launcher.resolved, model)
        lacking = scaler.lacking_credentials(specs)
        if lacking:
            return 400, {"error": lacking}
        try:
            launcher.provision_namespace(model.namespace)
        except Exception as exc:
            return 500, {"error": str(exc)}
        name = model.served_name
        self.failed.pop(name, None)
        scaler.models[name], scaler.pools[name] = model, desired_pools(model.up)
        scaler.forget_plans(name)
        launcher.deployment.models.append(ModelRecord(name, model.namespace, model.model_dir, model.prefix,
                                                      MODEL_STARTING, desired_pools(model.up)))
        scaler.admission.admit(specs)
        scaler.start_services(specs, scaler.cpus_of(name))
        launcher.say(f"serving model {name} in namespace {model.namespace}: starting "
                     f"{', '.join(s.name for s in specs)}; the gateway takes it once they are ready")
        scaler.publish()
        return 200, {"name": name, "namespace": model.namespace, "state": MODEL_STARTING,
                     "starting": [s.name for s in specs]}

    def _served(self, name: str) -> tuple[int, dict]:
        record = self._record(name)
        if record is not None and record.state == MODEL_STARTING:
            record.state = MODEL_SERVING
            self.launcher.say(f"the gateway serves model {name}")
        return 200, {}

    def _retire(self, name: str, failure: str | None) -> tuple[int, dict]:
        """Its services retire (they drain); with `failure`, it is listed as failed."""
        scaler, launcher = self.scaler, self.launcher
        record = self._record(name)
        if record is None or record.state == MODEL_STOPPING:
            return 409, {"error": f"{name} is not served"}
        members = scaler.members(name, roles=ROLES)
        scaler.pools.pop(name, None)
        record.state = MODEL_STOPPING
        for child in members:
            if child.state.value != "stopping":
                launcher.supervisor.retire(child.name, launcher.retire_timeout_s)
        if failure is not None:
            self.failed[name] = failure
            while len(self.failed) > MAX_FAILED:
                self.failed.pop(next(iter(self.failed)))
            launcher.say(f"warning: model {name} is not served: {failure}; its services retire")
        else:
            launcher.say(f"unserving model {name}: retiring {', '.join(c.name for c in members) or 'nothing'}")
        scaler.publish()
        return 200, {"name": name, "retiring": [c.name for c in members]}

    def step(self) -> None:
        """(main loop) A stopping model whose services are all gone is forgotten: its credentials are revoked with
        it (`Admission.admit`, next)."""
        dep = self.launcher.deployment
        for record in [m for m in dep.models if m.state == MODEL_STOPPING]:
            if not self.scaler.members(record.name, roles=ROLES):
                dep.models.remove(record)
                self.scaler.models.pop(record.name, None)
                self.scaler.forget_plans(record.name)
                self._cancelled.discard(record.name)
                self.launcher.say(f"model {record.name}'s services are gone" +
                                  (" (it failed)" if record.name in self.failed else "; it is unserved"))

    def _record(self, name: str) -> ModelRecord | None:
        return next((m for m in self.launcher.deployment.models if m.name == name), None)
