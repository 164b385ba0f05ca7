"""Tests of the native kernels: skipped only where the platform lacks what they need, failed where they do not
build (a broken kernel must not turn its tests into skips)."""

import pytest

from shared.engine.kernels import DISABLED, NO_COMPILER, unavailable_reason

PLATFORM_REASONS = (DISABLED, NO_COMPILER)


def _problem(name: str) -> tuple[str, str] | None:
    """("skip" or "fail", why) where the kernels `name` are not there; None where they are."""
    reason = unavailable_reason(name)
    if reason is None:
        return None
    return ("skip" if reason in PLATFORM_REASONS else "fail", f"native kernels {name!r}: {reason}")


def require_native(name: str) -> None:
    """In a test's body: go on only where the kernels `name` are built."""
    problem = _problem(name)
    if problem is not None:
        (pytest.skip if problem[0] == "skip" else pytest.fail)(problem[1])


def needs_native(name: str):
    """A mark for tests of the kernels `name`: skipped where the platform lacks a compiler (or they are turned off);
    where they fail to build, the module's collection fails."""
    problem = _problem(name)
    if problem is None:
        return pytest.mark.usefixtures()  # (no mark: nothing to say)
    if problem[0] == "skip":
        return pytest.mark.skip(reason=problem[1])
    raise RuntimeError(problem[1])
