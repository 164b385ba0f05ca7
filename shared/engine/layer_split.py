"""A model's layers as ranges, and how a pipeline splits them between its stages: pure, and light enough for the
launcher (no torch or transformers), which checks a split before anything starts."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from shared.engine.errors import ModelLoadError


@dataclass(slots=True, frozen=True)
class LayerRange:
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"invalid layer range [{self.start}, {self.end})")

    @property
    def num_layers(self) -> int:
        return self.end - self.start


class LayerSplitError(ValueError):
    """A layer split that cannot run: gaps, overlaps, out of range, or more stages than layers."""


def even_split(num_layers: int, num_stages: int) -> list[LayerRange]:
    """`num_stages` contiguous ranges covering `[0, num_layers)`; the first `num_layers % num_stages` get one more."""
    if num_stages < 1:
        raise LayerSplitError(f"a pipeline needs at least one stage, got {num_stages}")
    if num_stages > num_layers:
        raise LayerSplitError(f"{num_stages} stages cannot split {num_layers} layers: at most one stage per layer")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append(LayerRange(start, end))
        start = end
    return ranges


def parse_layer_split(text: str, num_layers: int) -> list[LayerRange]:
    """`"0:6,6:12,..."` as layer ranges, checked to cover `[0, num_layers)` exactly, in order."""
    ranges = []
    for index, item in enumerate(part.strip() for part in text.split(",")):
        try:
            start_text, end_text = item.split(":")
            start, end = int(start_text), int(end_text)
        except ValueError:
            raise LayerSplitError(f"layer range {index} is {item!r}; write START:END, e.g. 0:6") from None
        if not 0 <= start < end:
            raise LayerSplitError(f"layer range {index} ({item}) is empty or negative")
        ranges.append(LayerRange(start, end))
    check_layer_split(ranges, num_layers)
    return ranges


def check_layer_split(ranges: list[LayerRange], num_layers: int) -> None:
    if not ranges:
        raise LayerSplitError("a layer split needs at least one range")
    expected = 0
    for index, r in enumerate(ranges):
        if r.start > expected:
            raise LayerSplitError(f"layers [{expected}, {r.start}) are in no stage (a gap before range {index})")
        if r.start < expected:
            raise LayerSplitError(f"range {index} [{r.start}, {r.end}) overlaps the one before it (ends at {expected})")
        expected = r.end
    if expected != num_layers:
        if expected > num_layers:
            raise LayerSplitError(f"the split reaches layer {expected}, but the model has {num_layers} layers")
        raise LayerSplitError(f"layers [{expected}, {num_layers}) are in no stage")


def model_layer_count(model_dir: str | os.PathLike) -> int:
    """The model's decoder layers, from its config.json's `num_hidden_layers` (every architecture splitserve runs
    says them there); ModelLoadError where it cannot be read or does not say."""
    path = Path(model_dir) / "config.json"
    try:
        layers = json.loads(path.read_text()).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read the config of model directory {model_dir}: {exc}") from None
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ModelLoadError(f"{path} gives no number of layers (num_hidden_layers: {layers!r})")
    return layers
