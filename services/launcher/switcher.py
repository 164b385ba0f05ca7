"""`POST /v1/switch` on the launcher's control API: switch one worker between the prefill and decode pools.

On the control API's thread: the switch is checked against the view the main loop last published
(`switch_policy.check_switch`), one at a time; the `RoleSwitch` goes to the worker over NATS under the admin key,
which this launcher alone holds (the worker's control subject admits no other publisher: the switch is the
operator's by the bus's word, not by anyone's claim); once the worker answers that it serves in its new role, the
main loop counts it in its new pool (`Scaler.apply_switch`).
"""

from __future__ import annotations

import threading
from typing import Any

from services.launcher.admin_bus import send_switch
from services.launcher.scale_policy import ScaleError
from services.launcher.switch_policy import check_switch

SWITCH_MARGIN_S = 30.0  # past the drain: the engine quiescing, the new role starting, the registry


class Switches:
    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._one_at_a_time = threading.Lock()

    def handle(self, body: object) -> tuple[int, dict]:
        launcher = self.scaler.launcher
        o = launcher.options
        view = self.scaler.view()
        roles = {name: s["role"] for name, s in view.get("services", {}).items()}
        try:
            instance, to = check_switch(body, topology=o.topology, prefill_pipeline=o.prefill_stages is not None,
                                        role_switch=o.role_switch, roles=roles, retiring=view.get("retiring", []))
            drain_s = body.get("drain_s")
            if drain_s is not None and (not isinstance(drain_s, (int, float)) or isinstance(drain_s, bool)
                                        or not 0 <= drain_s <= 600):
                raise ScaleError("drain_s is seconds, 0 to 600")
        except ScaleError as exc:
            return 400, {"error": str(exc)}
        if o.nats_auth and launcher.admin is None:
            return 409, {"error": "this launcher holds no admin key (a --nats server without admin.nk): only the "
                                  "admin identity may switch a worker"}
        if not self._one_at_a_time.acquire(blocking=False):
            return 409, {"error": "another switch is under way; try again once it is done"}
        try:
            pid = view["services"][instance]["pid"]
            run = launcher.resolved
            try:
                reply = send_switch(run.nats_url, o.namespace, launcher.admin, run.nats_tls_ca, instance, to, drain_s,
                                    timeout_s=(drain_s or 30.0) + SWITCH_MARGIN_S)
            except Exception as exc:  # no answer: it may still be draining; `ps` shows where it ends up
                return 504, {"error": f"{instance} did not answer the switch: {type(exc).__name__}: {exc}"}
            if not reply.ok:
                return 409, {"error": f"{instance} refused the switch ({reply.code}): {reply.error}"}
            status, answer = self.scaler.submit(lambda: self.scaler.apply_switch(instance, to, pid))
            return status, {**answer, "instance": instance, "role": reply.role, "role_epoch": reply.role_epoch,
                            "drain_s": round(reply.drain_s, 4), "switch_s": round(reply.switch_s, 4)}
        finally:
            self._one_at_a_time.release()
