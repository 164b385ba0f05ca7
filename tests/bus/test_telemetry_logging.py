import json
import logging

import pytest
import structlog

from shared.telemetry import logging as telemetry

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def configured(capsys):
    telemetry.configure_logging("svc", "svc-1", "info")  # stderr is captured, not a TTY: JSON lines
    yield lambda: [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.strip()]
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, telemetry._StderrHandler)]
    root.setLevel(logging.WARNING)


def test_json_lines_carry_service_instance_and_bound_context(configured):
    log = telemetry.get_logger("bus.test")
    log.info("before binding", n_tokens=3)
    with structlog.contextvars.bound_contextvars(request_id="req-1", trace_id="t-9"):
        log.info("inside a request")
        logging.getLogger("nats.aio.client").warning("a %s line", "library")
    log.debug("below the level")

    before, inside, foreign = configured()
    assert before["event"] == "before binding" and before["n_tokens"] == 3 and before["level"] == "info"
    assert "request_id" not in before
    assert (inside["request_id"], inside["trace_id"], inside["logger"]) == ("req-1", "t-9", "bus.test")
    assert foreign["event"] == "a library line" and foreign["request_id"] == "req-1" and foreign["logger"] == "nats.aio.client"
    for line in (before, inside, foreign):
        assert (line["service"], line["instance"]) == ("svc", "svc-1")
        assert line["timestamp"].endswith("Z")


def test_exceptions_are_one_line_with_the_traceback(configured):
    try:
        raise KeyError("missing")
    except KeyError:
        telemetry.get_logger("x").exception("failed")
    (line,) = configured()
    assert line["level"] == "error" and "KeyError: 'missing'" in line["exception"]


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="loud"):
        telemetry.configure_logging("svc", "svc-1", "loud")
