"""`splitserve up --trace-viewer`: a local OTLP trace viewer (Arize Phoenix) on loopback, the services pointed at it.

Phoenix is an optional extra (`pip install 'splitserve[trace-viewer]'`, or any
install whose `phoenix` command is on PATH or named by $SPLITSERVE_PHOENIX); it
installs from the package index and runs offline. It listens on 127.0.0.1 only:
its UI and OTLP/HTTP on one port, OTLP/gRPC on another, its data in the run
directory.
"""

import os
import shutil
import sys
from pathlib import Path

PHOENIX_ENV = "SPLITSERVE_PHOENIX"


class TraceViewerError(RuntimeError):
    pass


def find_phoenix() -> str:
    """The `phoenix` command: $SPLITSERVE_PHOENIX, beside this Python, or on PATH."""
    candidates = [os.environ.get(PHOENIX_ENV), str(Path(sys.executable).parent / "phoenix"), shutil.which("phoenix")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise TraceViewerError(
        "--trace-viewer needs Arize Phoenix: pip install 'splitserve[trace-viewer]' (or point "
        f"${PHOENIX_ENV} at a `phoenix` command)")


def viewer_command(phoenix: str) -> list[str]:
    return [phoenix, "serve"]


def viewer_env(work_dir: Path, port: int, grpc_port: int) -> dict[str, str]:
    """Phoenix's settings: loopback only, its data under `work_dir`, no telemetry of its own."""
    return {"PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(grpc_port),
            "PHOENIX_WORKING_DIR": str(work_dir), "PHOENIX_TELEMETRY_ENABLED": "false"}


def exporter_env(port: int) -> dict[str, str]:
    """What points a service's OTLP exporter at the viewer."""
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
