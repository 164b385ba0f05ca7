"""Which NATS subjects each role may publish and subscribe to: least privilege, as data.

Pure: `role_permissions(role, subjects)` is what `splitserve up` (and
`splitserve nats-auth`) write into the server's authorization config, one user
per role. What a role may do follows from its job:

- every role keeps its own registry entries (`$KV.{bucket}.{role}.>`), reads
  everyone's, answers stats requests (which only the gateway asks), and takes replies only on its own inbox
  prefix (`inbox_prefix`), which no other role may subscribe to;
- replies to requests a role received go back through `allow_responses`, so
  nobody may publish into another's inbox;
- JetStream API subjects are granted per stream: the owner of a work queue may
  create it and pull from it, the producers may only publish into it.

A `stage` process may head a pipeline of either pool, so it holds the decode
and the prefill worker's permissions besides its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts import Subjects

ROLES = ("gateway", "scheduler", "decode", "prefill", "stage", "kvstore")
ADMIN = "admin"  # the operator: everything (debugging, `splitserve` tools); never given to a service


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True

    def to_config(self) -> dict:
        """The `permissions` block of a nats-server user."""
        return {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)},
                "allow_responses": self.allow_responses}


def inbox_prefix(namespace: str, role: str) -> str:
    """Where a role's connections take replies (request/reply, JetStream acks and pulls)."""
    return f"_INBOX.{namespace}.{role}"


def _stream_owner(stream: str) -> list[str]:
    return [f"$JS.API.STREAM.{verb}.{stream}" for verb in ("INFO", "CREATE", "UPDATE")]


def _consumer_provision(stream: str, durable: str) -> list[str]:
    """Create a durable consumer on `stream` and read its state."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.INFO.{stream}.{durable}"]


def _consumer_owner(stream: str, durable: str) -> list[str]:
    """Provision a durable pull consumer, pull from it and acknowledge what it delivers."""
    return [*_consumer_provision(stream, durable), f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>"]


def _registry(subjects: Subjects, role: str) -> list[str]:
    """Create and read the registry bucket; write only the entries of the roles `role` may act as."""
    stream = f"KV_{subjects.registry_bucket}"
    acts_as = (role, "decode", "prefill") if role == "stage" else (role,)  # a pipeline's head serves as its pool's worker
    return [*_stream_owner(stream), f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", *(f"$KV.{subjects.registry_bucket}.{r}.>" for r in acts_as)]


def _kvstore_client(s: Subjects) -> list[str]:
    return [s.any(lambda i: s.kvstore(i, endpoint)) for endpoint in ("lookup", "get", "put")]


def _decode(s: Subjects) -> tuple[list[str], list[str]]:
    publish = [s.any(s.tokens, 2), s.kv_events, s.worker_load, s.prefill_jobs, s.any(s.prefill_offer),
               *_kvstore_client(s),
               *_stream_owner(s.prefill_stream), *_consumer_provision(s.prefill_stream, s.prefill_consumer)]
    subscribe = [s.any(s.worker_generate), s.cancel, s.any(s.prefill_results), s.any(s.kv_snapshot)]
    return publish, subscribe


def _prefill(s: Subjects) -> tuple[list[str], list[str]]:
    publish = [s.any(s.prefill_results), s.kv_events, s.worker_load, *_kvstore_client(s), *_stream_owner(s.prefill_stream),
               *_consumer_owner(s.prefill_stream, s.prefill_consumer)]
    subscribe = [s.any(s.prefill_offer), s.cancel, s.any(s.kv_snapshot)]
    return publish, subscribe


def _stage(s: Subjects) -> tuple[list[str], list[str]]:
    link = [s.any(s.stage_activations), s.any(s.stage_tickets), s.any(s.stage_shipped)]
    publish, subscribe = list(link), list(link)
    for head in (_decode, _prefill):
        more_publish, more_subscribe = head(s)
        publish += more_publish
        subscribe += more_subscribe
    return publish, subscribe


def _gateway(s: Subjects) -> tuple[list[str], list[str]]:
    # It asks every service for its stats when its /metrics is scraped.
    return [s.submit, s.cancel, s.any(s.stats)], [s.any(s.tokens, 2)]


def _scheduler(s: Subjects) -> tuple[list[str], list[str]]:
    publish = [s.any(s.worker_generate), s.cancel, s.any(s.kv_snapshot), s.any(s.tokens, 2),
               *_stream_owner(s.requests_stream), *_consumer_owner(s.requests_stream, s.scheduler_consumer),
               f"$JS.API.CONSUMER.INFO.{s.prefill_stream}.{s.prefill_consumer}"]
    return publish, [s.kv_events, s.worker_load]


def _kvstore(s: Subjects) -> tuple[list[str], list[str]]:
    return [s.kv_events], [s.any(s.kvstore, 2), s.any(s.kv_snapshot)]


_JOBS = {"gateway": _gateway, "scheduler": _scheduler, "decode": _decode, "prefill": _prefill, "stage": _stage,
         "kvstore": _kvstore}


def role_permissions(role: str, subjects: Subjects) -> Permissions:
    """What one role's credential may do in the deployment named by `subjects`."""
    if role == ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    if role not in _JOBS:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    publish, subscribe = _JOBS[role](subjects)
    publish += ["$JS.API.INFO", *_registry(subjects, role)]
    subscribe += [subjects.any(subjects.stats), f"{inbox_prefix(subjects.namespace, role)}.>"]
    return Permissions(publish=tuple(dict.fromkeys(publish)), subscribe=tuple(dict.fromkeys(subscribe)))
