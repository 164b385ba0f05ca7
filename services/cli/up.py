"""`splitserve up`: the whole deployment on this machine, supervised.

The work is in `services.launcher.launcher`; the settings, and so the flags, in `services.launcher.up_settings`.
"""

import argparse
import os
import sys
from collections.abc import MutableMapping

from services.common.settings import add_flags, variables_of
from services.launcher.deployment import DEFAULT_RUN_DIR, RUN_DIR_ENV
from services.launcher.up_settings import UpSettings


def add_run_dir_option(parser: argparse.ArgumentParser) -> None:
    """`--run-dir`, for the commands that find a deployment by it (`ps`, `doctor`)."""
    parser.add_argument("--run-dir", metavar="DIR", help=f"{UpSettings.model_fields['run_dir'].description} "
                                                         f"(default: ${RUN_DIR_ENV}, else ./{DEFAULT_RUN_DIR})")


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "up",
        help="run a whole deployment on this machine (embedded NATS and every service)",
        description=(
            "Start an embedded NATS server with JetStream (unless --nats is given), then the scheduler, "
            "the decode workers and the gateway as supervised child processes (a service that crashes is "
            "restarted). Prints one line with the API URL once the gateway's /ready says every service is ready, "
            "then keeps running; Ctrl-C or SIGTERM stops everything. `splitserve ps` shows what runs."
        ),
    )
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="settings from a YAML file, by their flags' names (e.g. `topology: colocated`, "
                             "`decode: 2`); a flag or a SPLITSERVE_* variable given as well wins [SPLITSERVE_CONFIG]")
    add_flags(parser, UpSettings)
    parser.set_defaults(run=run)


def settings_of(args: argparse.Namespace, environ=None) -> UpSettings:
    """`up`'s settings from its flags, the SPLITSERVE_* environment and --config; exits 2 naming a bad one."""
    from services.common.settings import SettingsError, settings_from

    environ = os.environ if environ is None else environ
    try:
        return settings_from(UpSettings, args, args.config or environ.get("SPLITSERVE_CONFIG"), environ)
    except SettingsError as exc:
        print(f"splitserve up: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def forget_up_variables(environ: MutableMapping[str, str]) -> None:
    """Drop the variables `up` has read from the environment its services inherit: what they said is in each
    service's flags now, and a service that reads the same name (SPLITSERVE_DEVICE, SPLITSERVE_CPUS, ...) would
    take it where `up` passed no flag, over what `up` decided. The API keys reach the gateway alone, in its
    own environment."""
    for name in variables_of(UpSettings) | {"SPLITSERVE_CONFIG"}:
        environ.pop(name, None)


def run(args: argparse.Namespace) -> int:
    from services.launcher.deployment import resolve_run_dir
    from services.launcher.launcher import Launcher, install_signal_handlers, restore_signal_handlers

    settings = settings_of(args)
    forget_up_variables(os.environ)
    launcher = Launcher(settings.model_copy(update={"run_dir": resolve_run_dir(settings.run_dir)}))
    previous = install_signal_handlers(launcher)
    try:
        return launcher.run()
    finally:
        restore_signal_handlers(previous)
