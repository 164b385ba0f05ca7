"""A command line for the spawner's tests: `-m support.spawn_probe [report|sleep] [EXIT_CODE]`.

report: prints what it runs as (argv, cwd, its variables, its process group and session, whether torch was
imported before it started) as JSON and exits with
EXIT_CODE; sleep: prints its pid, then waits to be signalled."""

import json
import os
import sys
import time

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "report":
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid(),
                          "pgid": os.getpgid(0), "sid": os.getsid(0), "name": __name__,
                          "preloaded": "torch" in sys.modules}), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        raise SystemExit(int(sys.argv[2]))
    print(os.getpid(), flush=True)
    while True:
        time.sleep(1)
