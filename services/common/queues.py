"""The deployment's JetStream streams and registry bucket: provisioned by one identity, bound to by services.

`provision_deployment` makes (or brings to this configuration) the work queues
and the registry bucket; `up` runs it with its admin key before any service
starts, an operator with `splitserve provision`. On a secured bus no service
may change a stream: `join_deployment` then only binds, waiting for the
provisioner. On an open bus (no credentials) every service may, and the first
to start provisions.
"""

from contracts import Subjects
from shared.bus.provision import Replicas, ensure_pull_consumer, ensure_stream
from shared.bus.registry import Registry

# A request a scheduler pulled and did not ack (it died or froze) goes to another scheduler after this; a live
# scheduler renews it while it routes (services.scheduler.lease).
REQUEST_ACK_WAIT_S = 10.0


async def provision_request_queue(js, subjects: Subjects, replicas: Replicas = Replicas()) -> None:
    """gateway -> scheduler: bounded, de-duplicated by request id."""
    await ensure_stream(js, name=subjects.requests_stream, subjects=[subjects.submit], retention="workqueue",
                        max_msgs=100_000, max_bytes=1 << 30, max_age_s=600, duplicate_window_s=120,
                        replicas=replicas)
    await ensure_pull_consumer(js, stream=subjects.requests_stream, durable=subjects.scheduler_consumer,
                               filter_subject=subjects.submit, ack_wait_s=REQUEST_ACK_WAIT_S, max_deliver=5,
                               max_ack_pending=10_000)


async def provision_prefill_queue(js, subjects: Subjects, replicas: Replicas = Replicas()) -> None:
    """decode -> prefill pool. A short ack wait (kept alive by in-progress acks) gets a dead worker's job
    redelivered within seconds; a few deliveries at most, after which the decode worker prefills locally."""
    await ensure_stream(js, name=subjects.prefill_stream, subjects=[subjects.prefill_jobs], retention="workqueue",
                        max_msgs=100_000, max_bytes=1 << 30, max_age_s=300, duplicate_window_s=120,
                        replicas=replicas)
    await ensure_pull_consumer(js, stream=subjects.prefill_stream, durable=subjects.prefill_consumer,
                               filter_subject=subjects.prefill_jobs, ack_wait_s=4, max_deliver=3,
                               max_ack_pending=10_000)


async def provision_deployment(js, subjects: Subjects, replicas: Replicas = Replicas()) -> Registry:
    """Every stream, consumer and bucket of the deployment, as declared here; the registry last (services bound
    to it find the queues there)."""
    await provision_request_queue(js, subjects, replicas)
    await provision_prefill_queue(js, subjects, replicas)
    return await Registry.open(js, subjects.registry_bucket, replicas=replicas)


async def join_deployment(js, subjects: Subjects, replicas: Replicas, may_provision: bool) -> Registry:
    """A service's registry: provisioned first where the bus lets anyone (`may_provision`), else bound to."""
    if may_provision:
        return await provision_deployment(js, subjects, replicas)
    return await Registry.bind(js, subjects.registry_bucket)
