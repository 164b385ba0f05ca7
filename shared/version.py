"""splitserve's version, as its installed package says (`pyproject.toml`'s)."""

from importlib.metadata import PackageNotFoundError, version


def _installed() -> str:
    try:
        return version("splitserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


VERSION = _installed()
