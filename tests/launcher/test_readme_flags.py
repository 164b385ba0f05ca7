"""docs/configuration.md's list of `splitserve up` flags is the parser's: every flag it names is taken, and every
flag the parser takes is named (a --no-X switch by either of its spellings). The page is generated from the
settings classes (tests/test_config_docs.py keeps it current); this checks it against the parser `up` runs."""

import re
from pathlib import Path

from services.cli.main import build_parser

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def up_flags() -> dict[str, set[str]]:
    """Each of up's options (by its first spelling) -> all its spellings."""
    subcommands = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return {action.option_strings[0]: set(action.option_strings)
            for action in subcommands.choices["up"]._actions if action.option_strings[0] != "-h"}


def listed() -> set[str]:
    """The flags in the first column of the page's `splitserve up` table, and its "Also ..." lines."""
    text = CONFIGURATION.read_text()
    start = text.index("## `splitserve up`")
    end = text.find("\n## ", start + 1)
    flags = set()
    for line in text[start:end if end != -1 else None].splitlines():
        if line.startswith("| `--"):
            flags |= set(re.findall(r"`(--[a-z][a-z0-9-]*)`", line.split(" | ")[0]))
        elif line.startswith("Also `--"):
            flags |= set(re.findall(r"`(--[a-z][a-z0-9-]*)`", line.split(":")[0]))
    return flags


def test_every_flag_the_configuration_page_lists_is_taken_by_up():
    taken = set().union(*up_flags().values())
    assert not listed() - taken, f"docs/configuration.md lists flags `up` refuses: {sorted(listed() - taken)}"


def test_every_flag_up_takes_is_on_the_configuration_page():
    missing = [first for first, spellings in up_flags().items() if not spellings & listed()]
    assert not missing, f"`up` takes flags docs/configuration.md does not list: {missing}"
