import pytest

from support.deployment import start_deployment


@pytest.fixture(scope="package")
def colocated(nats_server, default_model, tmp_path_factory):
    """One colocated deployment for every module here that only sends it requests (each test's claims hold
    whatever the others sent before)."""
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model)
    yield deployment
    deployment.stop()
