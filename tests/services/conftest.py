import pytest

from support.deployment import start_deployment
from support.processes import NatsServer


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def colocated(nats_server, default_model, tmp_path_factory):
    deployment = start_deployment(nats_server.url, tmp_path_factory.mktemp("logs"), default_model)
    yield deployment
    deployment.stop()
