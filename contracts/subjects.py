"""NATS subject, stream and bucket names, all built from one namespace prefix.

Pools are `{ns}.{service}.{endpoint}`; one instance is
`{ns}.{service}.{instance}.{endpoint}`. Several deployments can share one NATS
cluster by using different namespaces.

A message whose receiver must know who sent it (a request's tokens, a prefill
result, KV events, load reports) goes to its subject with the sender's role and
instance id appended (`sent_by`): each instance's NATS permissions allow it
only subjects ending in its own name, so the server vouches for the sender and
the receiver reads it back with `sender_of`.
"""

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_ANY = "ANY-9f3c1e7a5b"  # a valid token standing for one wildcard position while a subject is built


def check_token(value: str, what: str) -> str:
    """Names used inside subjects may not contain '.', '*', '>' or spaces."""
    if not _TOKEN.match(value or ""):
        raise ValueError(f"{what} {value!r} may only contain letters, digits, '_' and '-'")
    return value


@dataclass(frozen=True, slots=True)
class Sender:
    """Who published a message, as its subject says (and the server's permissions vouch for)."""

    role: str
    instance_id: str

    def signs(self, subject: str) -> str:
        """`subject` as this sender publishes it (`sent_by`)."""
        return sent_by(subject, self.role, self.instance_id)


def sent_by(subject: str, role: str, instance_id: str) -> str:
    """`subject` as published by the instance `instance_id` of `role`."""
    return f"{subject}.{check_token(role, 'role')}.{check_token(instance_id, 'instance id')}"


def sender_of(subject: str) -> Sender:
    """The sender named by the last two tokens of a `sent_by` subject."""
    head, _, instance_id = subject.rpartition(".")
    role = head.rpartition(".")[2]
    return Sender(role, instance_id)


def model_namespace(namespace: str, served_name: str) -> str:
    """Where the pools of a deployment's model other than its first live: `{namespace}-{slug of its served name}`.

    Each model's scheduler, workers and kv-store run in a namespace of their own, so a worker's credential
    (issued for its namespace) reaches only its model's subjects; the gateway holds one connection per model.
    A name that does not make a valid token as it is (a '/', a '.') gets a short hash of itself appended, so two
    served names never share a namespace."""
    slug = re.sub(r"[^a-z0-9_-]+", "-", served_name.lower()).strip("-")[:40] or "model"
    if slug != served_name:
        slug += "-" + hashlib.blake2b(served_name.encode(), digest_size=3).hexdigest()
    return check_token(f"{namespace}-{slug}", "model namespace")


def from_anyone(subject: str) -> str:
    """The pattern matching `subject` as sent by every instance of every role."""
    return f"{subject}.*.*"


@dataclass(frozen=True, slots=True)
class Subjects:
    namespace: str  # the deployment's (its services' --namespace)

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    def any(self, subject_of: Callable[..., str], tokens: int = 1) -> str:
        """The pattern matching `subject_of(...)` for every instance (`*` in place of each of its `tokens` names),
        e.g. `subjects.any(subjects.worker_generate)` is `{ns}.worker.*.generate`."""
        return subject_of(*[_ANY] * tokens).replace(_ANY, "*")

    @property
    def all(self) -> str:
        """Every subject of this deployment."""
        return f"{self.namespace}.>"

    # JetStream: requests from gateways, taken by the scheduler pool.
    @property
    def requests_stream(self) -> str:
        return f"{self.namespace}-requests"

    @property
    def submit(self) -> str:
        return f"{self.namespace}.scheduler.submit"

    @property
    def scheduler_consumer(self) -> str:
        return "scheduler"

    # JetStream: prefill jobs from decode workers, taken by the prefill pool.
    @property
    def prefill_stream(self) -> str:
        return f"{self.namespace}-prefill"

    @property
    def prefill_jobs(self) -> str:
        return f"{self.namespace}.prefill.jobs"

    @property
    def prefill_consumer(self) -> str:
        return "prefill"

    # Core NATS.
    def prefill_offer(self, instance_id: str) -> str:
        """Where one prefill worker takes a job offered to it directly (its cache holds the prompt's prefix)."""
        return f"{self.namespace}.prefill.{check_token(instance_id, 'instance id')}.offer"

    def prefill_results(self, instance_id: str) -> str:
        return f"{self.namespace}.decode.{check_token(instance_id, 'instance id')}.prefill_result"

    def worker_generate(self, instance_id: str) -> str:
        return f"{self.namespace}.worker.{check_token(instance_id, 'instance id')}.generate"

    def stage_activations(self, instance_id: str) -> str:
        """Where a pipeline stage (or the head, for logits) takes steps' activations, in order."""
        return f"{self.namespace}.stage.{check_token(instance_id, 'instance id')}.activations"

    def stage_shipped(self, instance_id: str) -> str:
        """Where a pipelined prefill head hears that a stage shipped its layers of a prompt's KV."""
        return f"{self.namespace}.stage.{check_token(instance_id, 'instance id')}.shipped"

    def stage_tickets(self, instance_id: str) -> str:
        return f"{self.namespace}.stage.{check_token(instance_id, 'instance id')}.tickets"

    def kvstore(self, instance_id: str, endpoint: str) -> str:
        """A kv-store instance's endpoints: lookup, put, get."""
        return f"{self.namespace}.kvstore.{check_token(instance_id, 'instance id')}.{check_token(endpoint, 'endpoint')}"

    @property
    def kv_events(self) -> str:
        """Where workers and kv-stores publish the blocks they store and remove (schedulers listen)."""
        return f"{self.namespace}.kv.events"

    @property
    def worker_load(self) -> str:
        """Where engine workers say their load as it changes, between heartbeats (schedulers listen)."""
        return f"{self.namespace}.load"

    def kv_snapshot(self, instance_id: str) -> str:
        """Where one publisher of KV events takes requests for a snapshot."""
        return f"{self.namespace}.kv.{check_token(instance_id, 'instance id')}.snapshot"

    def stats(self, instance_id: str) -> str:
        return f"{self.namespace}.stats.{check_token(instance_id, 'instance id')}"

    def role_switch(self, instance_id: str) -> str:
        """Where one switchable worker takes the operator's `RoleSwitch`: only the admin key may publish here."""
        return f"{self.namespace}.control.{check_token(instance_id, 'instance id')}.switch"

    def gateway_models(self, instance_id: str) -> str:
        """Where one gateway takes the operator's `ServeModel` (start or stop routing a model): only the admin key
        may publish here."""
        return f"{self.namespace}.control.{check_token(instance_id, 'instance id')}.models"

    @property
    def cancel(self) -> str:
        return f"{self.namespace}.control.cancel"

    def tokens(self, gateway_id: str, request_id: str) -> str:
        """Where one request's events go; each gateway listens on its own wildcard."""
        return f"{self.namespace}.tokens.{check_token(gateway_id, 'gateway id')}.{check_token(request_id, 'request id')}"

    def tokens_wildcard(self, gateway_id: str) -> str:
        """Every request's events for one gateway, from every sender (`sent_by`)."""
        return from_anyone(f"{self.namespace}.tokens.{check_token(gateway_id, 'gateway id')}.*")

    # JetStream KV bucket of heartbeated service entries.
    @property
    def registry_bucket(self) -> str:
        return f"{self.namespace}-registry"
