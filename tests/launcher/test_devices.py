"""`up --device`, per-pool devices and `--gpu-memory-utilization`: checked before anything starts, and handed to
each model worker, whose own settings take them."""

import importlib

import pytest
from launcher_helpers import cli

from launcher_helpers import up_and_run

from services.launcher.topology import check_devices, plan


def disagg(**devices):
    prefill = 1 if "stage_ranges" in devices else 2
    return up_and_run(topology="disagg", prefill=prefill, decode=1, **devices)


def test_each_pool_gets_its_device_and_the_memory_share():
    specs = plan(*disagg(device="cuda", prefill_device="cuda:0", decode_device="cuda:1", gpu_memory_utilization=0.45))
    for spec in specs:
        if spec.role not in ("prefill", "decode"):
            assert "--device" not in spec.args and "--gpu-memory-utilization" not in spec.args, spec.name
            continue
        settings = importlib.import_module(f"services.{spec.role}.__main__").settings_of(list(spec.args), environ={})
        assert settings.device == {"prefill": "cuda:0", "decode": "cuda:1"}[spec.role]
        assert settings.gpu_memory_utilization == 0.45
    # On the CPU (the default) nothing is added.
    assert not any("--device" in s.args for s in plan(*disagg()))
    # A prefill pipeline's stages are the prefill pool's.
    stages = plan(*disagg(prefill_device="cuda:0", stage_ranges=((0, 2), (2, 4))))
    assert {s.name: s.args[s.args.index("--device") + 1] for s in stages if "--device" in s.args} == {
        "prefill-0": "cuda:0", "prefill-stage-1": "cuda:0"}


@pytest.mark.parametrize("args, says", [
    (("colocated", "cpu", "cuda", None, None, 1), "--prefill-device is the prefill pool's"),
    (("disagg", "cuda:1", None, None, None, 1), "device cuda:1 is not here: torch sees 1 CUDA device(s)"),
    (("disagg", "cpu", None, "cuda", 0.5, 1), "a model worker here runs on the CPU"),
    (("colocated", "cuda", None, None, 0.5, 0), "device cuda is not here"),
])
def test_devices_that_cannot_work_are_refused_by_name(args, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        check_devices(*args)
    check_devices("disagg", "cuda", "cuda:0", "cuda:1", 0.4, 2)  # every pool on a GPU that is there
    with pytest.raises(ValueError, match="pipeline stages"):
        check_devices("pipeline", "cuda", None, None, 0.4, 1, pipelined=True)


def test_up_on_a_machine_without_the_gpu_says_so_before_starting_anything(tmp_path):
    result = cli("up", "--run-dir", str(tmp_path / "run"), "--device", "cuda:7")
    assert result.returncode == 2 and "device cuda:7 is not here" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "logs").exists()
    result = cli("up", "--run-dir", str(tmp_path / "run"), "--device", "tpu")
    assert result.returncode == 2 and "argument --device" in result.stderr
