"""Service log files, bounded in size: each child's output is copied into LOG_DIR/NAME.log, rotated by size.

A child writes to a pipe; a thread copies each line into the file through the
standard library's `RotatingFileHandler`, which renames NAME.log to NAME.log.1
(.1 to .2, ...) once it would pass `max_bytes`, keeping `backups` old files.
A child that writes faster than the disk takes blocks on its pipe; no line is
dropped. Files are created by the launcher, whose umask (see `services`)
leaves them readable by its user alone.
"""

from __future__ import annotations

import logging
import os
import threading
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import BinaryIO

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_BACKUPS = 3


class RotatingLog:
    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS):
        if max_bytes <= 0 or backups < 1:
            raise ValueError("a log needs a positive size bound and at least one backup")
        self.path = Path(path)
        self._handler = RotatingFileHandler(self.path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8",
                                            errors="backslashreplace", delay=True)
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def write(self, line: str) -> None:
        """One line (without its newline)."""
        self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO, "levelname": "INFO"}))

    def follow(self, pipe: BinaryIO, name: str) -> threading.Thread:
        """Copy `pipe` line by line until it closes (the child and all it started are gone), then close it."""

        def copy() -> None:
            with pipe:
                for raw in iter(pipe.readline, b""):
                    self.write(raw.rstrip(b"\n").decode("utf-8", errors="backslashreplace"))

        thread = threading.Thread(target=copy, name=f"log-{name}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._handler.close()
