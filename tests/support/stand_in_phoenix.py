"""A stand-in for `phoenix serve` (the real one is an optional extra, not installed in CI): it honours the same
settings (PHOENIX_HOST, PHOENIX_PORT, PHOENIX_WORKING_DIR), answers GET / once up, and takes OTLP/HTTP traces at
/v1/traces like Phoenix, appending each span as a JSON line to PHOENIX_WORKING_DIR/spans.jsonl."""

import json
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.otlp_receiver import OtlpHttpReceiver  # noqa: E402


def main() -> None:
    assert sys.argv[1:] == ["serve"], sys.argv
    host, port = os.environ["PHOENIX_HOST"], int(os.environ["PHOENIX_PORT"])
    work = Path(os.environ["PHOENIX_WORKING_DIR"])
    work.mkdir(parents=True, exist_ok=True)
    receiver = OtlpHttpReceiver(host, port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    written = 0
    with open(work / "spans.jsonl", "a") as out:
        while not stop.wait(0.1):
            with receiver.lock:
                fresh = receiver.spans[written:]
            for span in fresh:
                out.write(json.dumps({"service": span.service, "name": span.name, "trace_id": span.trace_id,
                                      "span_id": span.span_id, "parent_span_id": span.parent_span_id}) + "\n")
            written += len(fresh)
            out.flush()
    receiver.stop()


if __name__ == "__main__":
    main()
