import pytest

from support.deployment import start_deployment, start_pipeline


@pytest.fixture(scope="package")
def colocated(nats_server, default_model, tmp_path_factory):
    """One colocated deployment for every module here that only sends it requests (cancel and bus rejects, the
    gateway fuzz, HTTP errors, the openai client): each test's claims hold whatever the others sent before."""
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model)
    yield deployment
    deployment.stop()


@pytest.fixture(scope="package")
def two_stages(nats_server, default_model, tmp_path_factory):
    """A pipeline of two stages (layers 0-2, 2-4; prefill chunks over the side channel, decode steps inline), its
    head serving its own status: checked against transformers, then a stage killed under a stream (test_pipeline),
    and the head's /ready following its stage (test_status_endpoint)."""
    small = ("--inline-activation-bytes", str(16 << 10))
    deployment = start_pipeline(nats_server.url, tmp_path_factory.mktemp("logs"), default_model, [(0, 2), (2, 4)],
                                microbatches=2, head_args=small, stage_args=small, head_status=True)
    yield deployment
    deployment.stop()
