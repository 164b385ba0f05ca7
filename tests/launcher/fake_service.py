"""Stands in for `python -m services.ROLE FLAGS...` in the launcher tests.

The gateway fake answers GET /ready with $FAKE_HEALTH (default 200), saying
every service is ready, and GET /health with 200. A role named in $FAKE_CRASH,
or in the file $FAKE_CRASH_FILE names, exits 1 at once. Every fake exits 0 on
SIGTERM. A model worker given --cpus-file answers its placement file as a real one does (FILE.ack), without
moving; with $FAKE_REFUSE_CPUS set it refuses every placement after its first (generation 0), and with
$FAKE_SILENT_CPUS it never answers one after its first.
"""

import argparse
import http.server
import json
import os
import signal
import sys
import threading
import time


def main(argv: list[str]) -> int:
    assert argv[0] == "-m" and argv[1].startswith("services."), argv
    role = argv[1].split(".", 1)[1]
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--instance-id")
    parser.add_argument("--cpus-file")
    args, _ = parser.parse_known_args(argv[2:])
    print(f"fake {role} {args.instance_id}: {' '.join(argv)}", flush=True)
    crash_file = os.environ.get("FAKE_CRASH_FILE")
    crashing = os.environ.get("FAKE_CRASH", "").split(",")
    if crash_file and os.path.exists(crash_file):
        with open(crash_file) as f:
            crashing += f.read().split(",")
    if role in crashing:
        print("fake crash", flush=True)
        return 1

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    server = None
    if role == "gateway":
        status = int(os.environ.get("FAKE_HEALTH", "200"))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = b'{"status": "ready"}' if self.path == "/ready" else b"{}"
                self.send_response({"/ready": status, "/health": 200}.get(self.path, 404))
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    seen = None
    while not stopping:
        if args.cpus_file:
            seen = answer_placement(args.cpus_file, seen)
        time.sleep(0.05)
    if server is not None:
        server.shutdown()
        server.server_close()
    print("fake stopped", flush=True)
    return 0


def answer_placement(path: str, seen):
    """The placement file's new version answered (the protocol of services.common.cpu_placement); the version seen."""
    try:
        with open(path) as fh:
            version = os.fstat(fh.fileno()).st_mtime_ns, os.fstat(fh.fileno()).st_ino
            if version == seen:
                return seen
            placement = json.load(fh)
    except FileNotFoundError:
        return seen
    generation = placement["generation"]
    if generation > 0 and os.environ.get("FAKE_SILENT_CPUS"):
        return version
    if generation > 0 and os.environ.get("FAKE_REFUSE_CPUS"):
        ack = {"generation": generation, "applied": False, "error": "fake refusal"}
    else:
        ack = {"generation": generation, "applied": True, "cpus": placement["cpus"],
               "borrow_cpus": placement.get("borrow_cpus", "")}
    tmp = f"{path}.ack.tmp"
    with open(tmp, "w") as fh:
        json.dump(ack, fh)
    os.replace(tmp, f"{path}.ack")
    return version


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
