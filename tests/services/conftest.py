import pytest

from support.deployment import start_deployment


@pytest.fixture(scope="module")
def colocated(nats_server, default_model, tmp_path_factory):
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model)
    yield deployment
    deployment.stop()
