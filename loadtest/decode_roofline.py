"""The batch-1 decode roofline: how close a decode step comes to reading its bytes at the memory's speed.

A batch-1 decode step reads every weight once and the sequence's KV so far; at batch 1 nothing else is large, so
the fastest a step can be is (those bytes) / (memory bandwidth). From a `loadtest.bench_engine` result (its model
and its measured ms/token, engine and transformers), this reports the bytes a step reads, the bytes/s each side
achieved, and that as a share of two peaks: the device's datasheet figure where the device is known, and what a
device-to-device copy achieves here, measured in this run (counting the bytes read and written).

    python -m loadtest.decode_roofline engine-1b.json --output roofline.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

# Datasheet HBM bandwidth, bytes/s, by the name torch reports (a substring of it).
DATASHEET_BYTES_PER_S = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_bytes(model: dict[str, Any], dtype: str, context_tokens: float) -> float:
    """Bytes a batch-1 decode step reads: every weight, and the KV of `context_tokens` tokens."""
    size = DTYPE_BYTES[dtype]
    kv = (model["num_hidden_layers"] * 2 * model["num_key_value_heads"] * model["head_dim"] * context_tokens * size)
    return model["num_parameters"] * size + kv


def datasheet_peak(device_name: str | None) -> float | None:
    for name, peak in DATASHEET_BYTES_PER_S.items():
        if device_name and name in device_name:
            return peak
    return None


def measured_copy_peak(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float | None:
    """Bytes/s a device-to-device copy moves here (read + write), median of `repeats`; None off CUDA."""
    import torch

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def roofline(results: dict[str, Any], copy_peak: float | None) -> dict[str, Any]:
    config, model, decode = results["config"], results["model"], results["decode_batch1"]
    # The context a step attends to grows from the prompt to prompt + N: its mean is halfway.
    context = config["decode_prompt_len"] + config["decode_tokens"] / 2
    nbytes = step_bytes(model, config["dtype"], context)
    datasheet = datasheet_peak(results["machine"].get("device_name"))
    out: dict[str, Any] = {"device_name": results["machine"].get("device_name"), "dtype": config["dtype"],
                           "num_parameters": model["num_parameters"], "step_bytes": nbytes,
                           "datasheet_bytes_per_s": datasheet, "copy_bytes_per_s": copy_peak}
    for side in ("engine", "transformers"):
        ms = decode[side]["ms_per_token"]
        achieved = nbytes / (ms / 1e3)
        out[side] = {"ms_per_token": ms, "bytes_per_s": achieved,
                     "share_of_datasheet": achieved / datasheet if datasheet else None,
                     "share_of_copy": achieved / copy_peak if copy_peak else None}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.decode_roofline", description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a loadtest.bench_engine result (JSON)")
    parser.add_argument("--output", help="write the roofline as JSON here")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.result).read_text())
    report = roofline(results, measured_copy_peak(results["config"]["device"]))
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
