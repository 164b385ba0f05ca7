"""A worker's CPU placement as the launcher hands it over at runtime: the placement file and its ack.

The launcher writes a worker's placement file (its --cpus-file) whole and at once, mode 0600, each time it
moves the worker: a JSON object with a generation number (higher than the last), the worker's CPUs and, for a
decode worker borrowing an idle prefill worker's CPUs, the CPUs it borrows (its lender's now; empty: no loan
while they are not one CPU each). The worker follows it between engine steps (`services.common.cpu_follow`)
and answers in FILE.ack, also whole and 0600: the generation it took, whether it applied it and, if not, why.

    {"generation": 4, "cpus": "2-3", "borrow_cpus": ""}
    {"generation": 4, "applied": true, "cpus": "2-3", "borrow_cpus": ""}
    {"generation": 5, "applied": false, "error": "CPUs 9 are not available to this worker (it may use 0,1,2,3)"}

Parsing and formatting are pure; `write_placement` and `read_ack` are the launcher's, `write_ack` the worker's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from services.common.cpus import format_cpu_list, parse_cpu_list
from shared.private_files import write_private


@dataclass(frozen=True)
class Placement:
    generation: int
    cpus: tuple[int, ...]
    borrow_cpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Ack:
    generation: int | None  # None: the file was not a placement at all
    applied: bool
    error: str = ""


def _cpus(text: object, name: str) -> tuple[int, ...]:
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a CPU list in a string (e.g. \"0-3,6\"), got {text!r}")
    return parse_cpu_list(text) if text.strip() else ()


def parse_placement(text: str) -> Placement:
    """The placement in a file's text; ValueError saying what is wrong with it."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")
    unknown = sorted(set(fields) - {"generation", "cpus", "borrow_cpus"})
    if unknown:
        raise ValueError(f"unknown fields {', '.join(unknown)}")
    generation = fields.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise ValueError(f"generation must be a whole number >= 0, got {generation!r}")
    cpus = _cpus(fields.get("cpus"), "cpus")
    if not cpus:
        raise ValueError("cpus names no CPU: a worker runs on one at least")
    borrow = _cpus(fields.get("borrow_cpus", ""), "borrow_cpus")
    if set(cpus) & set(borrow):
        raise ValueError("borrow_cpus must not overlap cpus")
    return Placement(generation, cpus, borrow)


def format_placement(placement: Placement) -> str:
    return json.dumps({"generation": placement.generation, "cpus": format_cpu_list(placement.cpus),
                       "borrow_cpus": format_cpu_list(placement.borrow_cpus)})


def format_ack(ack: Ack, placement: Placement | None = None) -> str:
    fields: dict = {"generation": ack.generation, "applied": ack.applied}
    if placement is not None and ack.applied:
        fields |= {"cpus": format_cpu_list(placement.cpus), "borrow_cpus": format_cpu_list(placement.borrow_cpus)}
    if ack.error:
        fields["error"] = ack.error
    return json.dumps(fields)


def parse_ack(text: str) -> Ack:
    fields = json.loads(text)
    return Ack(fields.get("generation"), bool(fields.get("applied")), fields.get("error", ""))


def ack_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".ack")


def write_placement(path: str | os.PathLike, placement: Placement) -> None:
    """The launcher's: replace the worker's placement file at once (mode 0600)."""
    write_private(path, format_placement(placement).encode())


def write_ack(path: str | os.PathLike, ack: Ack, placement: Placement | None = None) -> None:
    """The worker's: answer the placement file at `path` (in `path`.ack, mode 0600)."""
    write_private(ack_path(path), format_ack(ack, placement).encode())


def placement_acked(path: str | os.PathLike, generation: int) -> bool | None:
    """The launcher's wait: True once the worker applied `generation`, False if it refused it, None before it
    answered it."""
    ack = read_ack(path)
    return None if ack is None or ack.generation != generation else ack.applied


def read_ack(path: str | os.PathLike) -> Ack | None:
    """The worker's last answer to the placement file at `path`; None before its first."""
    try:
        return parse_ack(ack_path(path).read_text())
    except FileNotFoundError:
        return None
