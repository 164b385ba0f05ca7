"""Which NATS subjects each service instance may publish and subscribe to: least privilege, as data.

Pure: `instance_permissions(role, instance_id, subjects)` is what `splitserve up`
(and `splitserve nats-auth`) write into the server's authorization config, one
user per service instance. What an instance may do follows from its job, and
only as itself:

- it takes only its own work (`worker.<its id>.generate`, its own offers, KV
  snapshot and stats requests), and takes replies only on its own inbox prefix
  (`inbox_prefix`), which no other instance may subscribe to;
- it answers requests only into the inboxes of the roles whose requests it
  serves (`_ANSWERS`), not wherever a request's reply subject points: NATS's
  `allow_responses` would let an asker name any subject (another's registry
  entry, a signed token subject) and have the answer published there under the
  responder's name;
- what a receiver must attribute (a request's tokens, a prefill result, KV
  events, load reports) it sends only under its own name (`contracts.sent_by`),
  so the server vouches for the sender;
- it writes only its own registry entry (`$KV.{bucket}.{role}.{id}`) and reads
  everyone's; rollups and purges are refused by the bucket itself;
- JetStream: it binds to the streams and consumers its job uses (info, pull,
  ack, publish into a queue); creating, changing, purging or deleting a stream
  or consumer is the provisioner's alone (`ADMIN`: `splitserve up`, or the
  operator's `splitserve provision`).

A decode or prefill worker of a deployment that switches roles (`up --role-switch`) is `switchable`: it holds
both roles' permissions under its own name, and may take the operator's `RoleSwitch` on its own control subject
(`Subjects.role_switch`), which no role may publish to: only `ADMIN` (the launcher, for `splitserve switch`). The
switch is the operator's by the bus's word, as nothing else can send it.

A `stage` process may head a pipeline of either pool, so it holds the decode
and the prefill worker's permissions (under its own name) besides its own. A
stage sends steps only along the pipelines it is part of (`Pipeline`): to the
next stage, and back to the head (logits, a step's failure, KV shipped); a
stage of no declared pipeline sends none.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts import Subjects, check_token, from_anyone

ROLES = ("gateway", "scheduler", "decode", "prefill", "stage", "kvstore")
ADMIN = "admin"  # the operator and the provisioner: everything; never given to a service
_ACTS_AS = {"stage": ("stage", "decode", "prefill")}  # a pipeline's head serves as its pool's worker
SWITCHABLE = ("decode", "prefill")  # a switchable worker acts as both
# Whose requests each role answers, besides stats requests (every gateway's, and the operator's from an admin
# connection whose inbox is `inbox_prefix(ns, "admin", "admin")`): the kv-store the model workers' lookups, puts
# and gets; a prefill worker the decode workers' offers; a decode worker the scheduler's handoffs; a
# stage all of those as a pipeline's head, and the other stages' ticket requests.
_ANSWERS = {"kvstore": ("decode", "prefill", "stage"), "prefill": ("decode", "stage"), "decode": ("scheduler",),
            "stage": ("scheduler", "decode", "stage")}


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False

    def to_config(self) -> dict:
        """The `permissions` block of a nats-server user."""
        return {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)},
                "allow_responses": self.allow_responses}


def merged(*permissions: Permissions) -> Permissions:
    """One credential's permissions for several deployments' jobs (a gateway routing several models: its
    gateway permissions in each model's namespace)."""
    publish = [subject for p in permissions for subject in p.publish]
    subscribe = [subject for p in permissions for subject in p.subscribe]
    return Permissions(publish=tuple(dict.fromkeys(publish)), subscribe=tuple(dict.fromkeys(subscribe)),
                       allow_responses=any(p.allow_responses for p in permissions))


def acts_as(role: str, switchable: bool = False) -> tuple[str, ...]:
    """The roles an instance of `role` may speak as (its registry entries, the names it signs with)."""
    if switchable and role in SWITCHABLE:
        return SWITCHABLE
    return _ACTS_AS.get(role, (role,))


def inbox_prefix(namespace: str, role: str, instance_id: str) -> str:
    """Where one instance's connection takes replies (request/reply, JetStream acks and pulls)."""
    return f"_INBOX.{namespace}.{check_token(role, 'role')}.{check_token(instance_id, 'instance id')}"


@dataclass(frozen=True)
class Pipeline:
    """A head and its stages, in layer order: steps go head -> stages[0] -> ... -> the last, then back."""

    head: str
    stages: tuple[str, ...]

    def sends_to(self, instance_id: str) -> tuple[set[str], set[str]]:
        """(whom `instance_id` sends steps to here, the heads it reports to): nothing where it is not a member."""
        chain = (self.head, *self.stages)
        if instance_id not in chain:
            return set(), set()
        position = chain.index(instance_id)
        after = {chain[position + 1]} if position + 1 < len(chain) else set()
        return after | ({self.head} if instance_id != self.head else set()), {self.head} - {instance_id}


@dataclass(frozen=True)
class _Me:
    """One instance, and the subjects it may sign with its name."""

    s: Subjects
    role: str
    id: str
    pipelines: tuple[Pipeline, ...] = ()
    switchable: bool = False

    @property
    def roles(self) -> tuple[str, ...]:
        return acts_as(self.role, self.switchable)

    def signed(self, subject_pattern: str) -> list[str]:
        return [f"{subject_pattern}.{role}.{self.id}" for role in self.roles]


def _consumer_bind(stream: str, durable: str) -> list[str]:
    """Bind to a durable pull consumer, pull from it and acknowledge what it delivers."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>"]


def _registry(me: _Me) -> list[str]:
    """Read the registry bucket; write only this instance's own entries."""
    bucket = me.s.registry_bucket
    stream = f"KV_{bucket}"
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", *(f"$KV.{bucket}.{role}.{me.id}" for role in me.roles)]


def _kvstore_client(me: _Me) -> list[str]:
    """Ask any kv-store, under its own name (a store serves only registered workers of the model they name)."""
    s = me.s
    return [p for endpoint in ("lookup", "get", "put") for p in me.signed(s.any(lambda i: s.kvstore(i, endpoint)))]


def _reports(me: _Me) -> list[str]:
    """What every engine worker tells the schedulers: its KV events and its load."""
    return [*me.signed(me.s.kv_events), *me.signed(me.s.worker_load)]


def _decode(me: _Me) -> tuple[list[str], list[str]]:
    s = me.s
    publish = [*me.signed(f"{s.namespace}.tokens.*.*"), *_reports(me), s.prefill_jobs, s.any(s.prefill_offer),
               *_kvstore_client(me), f"$JS.API.STREAM.INFO.{s.prefill_stream}"]
    subscribe = [s.worker_generate(me.id), s.cancel, from_anyone(s.prefill_results(me.id)), s.kv_snapshot(me.id)]
    return publish, subscribe


def _prefill(me: _Me) -> tuple[list[str], list[str]]:
    s = me.s
    publish = [*me.signed(s.any(s.prefill_results)), *_reports(me), *_kvstore_client(me),
               *_consumer_bind(s.prefill_stream, s.prefill_consumer)]
    subscribe = [s.prefill_offer(me.id), s.cancel, s.kv_snapshot(me.id)]
    return publish, subscribe


def _stage(me: _Me) -> tuple[list[str], list[str]]:
    s = me.s
    steps_to, heads = set(), set()
    for pipeline in me.pipelines:
        more_steps, more_heads = pipeline.sends_to(me.id)
        steps_to |= more_steps
        heads |= more_heads
    publish = [*(subject for to in sorted(steps_to) for subject in (s.stage_activations(to), s.stage_tickets(to))),
               *(s.stage_shipped(head) for head in sorted(heads))]
    subscribe = [s.stage_activations(me.id), s.stage_tickets(me.id), s.stage_shipped(me.id)]
    for head in (_decode, _prefill):
        more_publish, more_subscribe = head(me)
        publish += more_publish
        subscribe += more_subscribe
    return publish, subscribe


def _gateway(me: _Me) -> tuple[list[str], list[str]]:
    s = me.s
    # It asks every service for its stats when its /metrics is scraped; it takes the operator's model changes.
    return [s.submit, s.cancel, s.any(s.stats)], [s.tokens_wildcard(me.id), s.gateway_models(me.id)]


def _scheduler(me: _Me) -> tuple[list[str], list[str]]:
    s = me.s
    publish = [s.any(s.worker_generate), s.cancel, s.any(s.kv_snapshot), *me.signed(f"{s.namespace}.tokens.*.*"),
               *_consumer_bind(s.requests_stream, s.scheduler_consumer),
               f"$JS.API.CONSUMER.INFO.{s.prefill_stream}.{s.prefill_consumer}"]
    return publish, [from_anyone(s.kv_events), from_anyone(s.worker_load)]


def _kvstore(me: _Me) -> tuple[list[str], list[str]]:
    s = me.s
    return me.signed(s.kv_events), [f"{s.namespace}.kvstore.{me.id}.>", s.kv_snapshot(me.id)]


def _switchable(me: _Me) -> tuple[list[str], list[str]]:
    """A worker that switches between decode and prefill: both jobs, and the operator's switches."""
    publish, subscribe = [], [me.s.role_switch(me.id)]
    for job in (_decode, _prefill):
        more_publish, more_subscribe = job(me)
        publish += more_publish
        subscribe += more_subscribe
    return publish, subscribe


_JOBS = {"gateway": _gateway, "scheduler": _scheduler, "decode": _decode, "prefill": _prefill, "stage": _stage,
         "kvstore": _kvstore}


def instance_permissions(role: str, instance_id: str, subjects: Subjects,
                         pipelines: tuple[Pipeline, ...] = (), switchable: bool = False) -> Permissions:
    """What one service instance's credential may do in the deployment named by `subjects` (a stage's: along
    `pipelines`; a decode or prefill worker's, `switchable`: as both)."""
    if role == ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    if role not in _JOBS:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    switchable = switchable and role in SWITCHABLE
    me = _Me(subjects, role, check_token(instance_id, "instance id"), tuple(pipelines), switchable)
    publish, subscribe = (_switchable if switchable else _JOBS[role])(me)
    askers = [asker for acting in me.roles for asker in _ANSWERS.get(acting, ())] if switchable else _ANSWERS.get(role, ())
    publish += ["$JS.API.INFO", *_registry(me),
                *(f"_INBOX.{subjects.namespace}.{asker}.*.>" for asker in (*askers, "gateway", ADMIN))]
    subscribe += [subjects.stats(instance_id), f"{inbox_prefix(subjects.namespace, role, instance_id)}.>"]
    return Permissions(publish=tuple(dict.fromkeys(publish)), subscribe=tuple(dict.fromkeys(subscribe)))
