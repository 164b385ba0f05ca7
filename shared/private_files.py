"""Files and directories only their owner may read (keys, credentials, the deployment's record, users' KV)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def private_dir(path: str | os.PathLike) -> Path:
    """`path` (and its parents) created if missing, and mode 0700 whatever it was or the umask says."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` at once (a reader sees the old file or the new one, never half), mode 0600."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
