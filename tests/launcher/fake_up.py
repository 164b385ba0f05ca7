"""The real launcher, with fake services: `fake_up.py RUN_DIR PORT FAKEPYTHON MODEL DECODE READY_TIMEOUT`.

Restarts back off from 0.05 s; $FAKE_MAX_RESTARTS caps them (default 5); a service marked failed is tried
again after $FAKE_FAILED_RETRY_S (default 60). $FAKE_UP_CPUS: up's --cpus (default auto).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.launcher.launcher import Launcher, install_signal_handlers  # noqa: E402
from services.launcher.up_settings import UpSettings  # noqa: E402
from services.launcher.supervisor import RestartPolicy  # noqa: E402


def main() -> int:
    run_dir, port, python, model, decode, ready_timeout = sys.argv[1:7]
    options = UpSettings(run_dir=Path(run_dir), models=(model,), port=int(port), decode=int(decode), topology="colocated",
                         ready_timeout_s=float(ready_timeout), cpus=os.environ.get("FAKE_UP_CPUS", "auto"))
    policy = RestartPolicy(base_delay_s=0.05, max_delay_s=0.2, max_restarts=int(os.environ.get("FAKE_MAX_RESTARTS", "5")),
                           failed_retry_s=float(os.environ.get("FAKE_FAILED_RETRY_S", "60")))
    launcher = Launcher(options, policy=policy, python=python, poll_interval_s=0.05)
    install_signal_handlers(launcher)
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
