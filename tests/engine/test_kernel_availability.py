"""A kernel that fails to build fails its tests; only a platform without a compiler (or kernels turned off) skips
them (issue 36, item 6)."""

import pytest
from _pytest.outcomes import Failed, Skipped

import support.kernels as kernels
from shared.engine import kernels as engine_kernels


@pytest.fixture
def unavailable(monkeypatch):
    def because(reason):
        monkeypatch.setattr(kernels, "unavailable_reason", lambda name: reason)

    return because


def test_a_build_failure_fails_and_a_missing_compiler_skips(unavailable):
    unavailable("the build failed: cc: error: unrecognized option")
    with pytest.raises(Failed, match="the build failed"):
        kernels.require_native("layer_ops")
    with pytest.raises(RuntimeError, match="the build failed"):
        kernels.needs_native("layer_ops")
    for reason in (engine_kernels.NO_COMPILER, engine_kernels.DISABLED):
        unavailable(reason)
        with pytest.raises(Skipped, match=reason.split(" (")[0]):
            kernels.require_native("layer_ops")
        assert kernels.needs_native("layer_ops").name == "skip"
    unavailable(None)
    kernels.require_native("layer_ops")  # built: nothing to say
    assert kernels.needs_native("layer_ops").name == "usefixtures"


def test_the_engine_says_why_its_kernels_are_missing(monkeypatch, tmp_path):
    engine_kernels.native_library.cache_clear()
    try:
        monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
        assert engine_kernels.unavailable_reason("layer_ops").startswith("the build failed")
        monkeypatch.setenv("SPLITSERVE_NATIVE_KERNELS", "0")
        engine_kernels.native_library.cache_clear()
        assert engine_kernels.unavailable_reason("layer_ops") == engine_kernels.DISABLED
    finally:
        engine_kernels.native_library.cache_clear()
