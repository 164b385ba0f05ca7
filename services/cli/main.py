"""The `splitserve` command: one entry point, one module per subcommand."""

import argparse
import os
import sys

from services.cli import bench, config_docs, doctor, generate, models, nats_auth, provision, ps, scale, serve, switch, up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving over NATS.")
    subcommands = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(subcommands)
    up.add_parser(subcommands)
    ps.add_parser(subcommands)
    scale.add_parser(subcommands)
    switch.add_parser(subcommands)
    serve.add_parser(subcommands)
    doctor.add_parser(subcommands)
    bench.add_parser(subcommands)
    models.add_parser(subcommands)
    nats_auth.add_parser(subcommands)
    provision.add_parser(subcommands)
    config_docs.add_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader left (`splitserve ps | head`): not an error. Python's last flush of stdout at exit would
        # raise again, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
