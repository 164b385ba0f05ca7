"""The README's list of `splitserve up` flags is the parser's: every flag it names is taken, and every flag the
parser takes is named (a --no-X switch by either of its spellings)."""

import re
from pathlib import Path

from services.cli.main import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def up_flags() -> dict[str, set[str]]:
    """Each of up's options (by its first spelling) -> all its spellings."""
    subcommands = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return {action.option_strings[0]: set(action.option_strings)
            for action in subcommands.choices["up"]._actions if action.option_strings[0] != "-h"}


def listed() -> set[str]:
    text = README.read_text()
    start = text.index("Flags of `splitserve up`:")
    return set(re.findall(r"--[a-z][a-z0-9-]*", text[start:text.index("\n\n", start)]))


def test_every_flag_the_readme_lists_is_taken_by_up():
    taken = set().union(*up_flags().values())
    assert not listed() - taken, f"the README lists flags `up` refuses: {sorted(listed() - taken)}"


def test_every_flag_up_takes_is_in_the_readme():
    missing = [first for first, spellings in up_flags().items() if not spellings & listed()]
    assert not missing, f"`up` takes flags the README does not list: {missing}"
