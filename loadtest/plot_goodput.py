"""The goodput figure of `bench_goodput`'s results: SLO attainment against request rate for every configuration
(the sweep), beside each configuration's attainment on every phase of the shifting trace.

    python -m loadtest.plot_goodput loadtest/results/goodput_cpu.json docs/goodput-cpu.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(results: dict[str, dict | None], target: float, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {name: result for name, result in results.items() if result}
    figure, (sweep_axis, trace_axis) = plt.subplots(1, 2, figsize=(13, 4.4))
    for name, result in measured.items():
        rows = result["sweep"]["rows"]
        sweep_axis.plot([r["rate"] for r in rows], [100 * (r["slo_attainment"] or 0) for r in rows], marker="o",
                        label=name)
    sweep_axis.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    sweep_axis.set_xlabel("request rate (req/s)")
    sweep_axis.set_ylabel("requests meeting both SLOs (%)")
    sweep_axis.set_title("rate sweep")
    sweep_axis.grid(alpha=0.3)
    sweep_axis.legend(fontsize=8)

    phases = list(dict.fromkeys(p for r in measured.values() for p in r["trace"].get("phases", {})))
    columns = ["overall", *phases]
    width = 0.8 / max(1, len(measured))
    for index, (name, result) in enumerate(measured.items()):
        trace = result["trace"]
        values = [trace["slo_attainment"], *(trace.get("phases", {}).get(p, {}).get("slo_attainment") for p in phases)]
        trace_axis.bar([c + index * width for c in range(len(columns))], [100 * (v or 0) for v in values],
                       width=width, label=name)
    trace_axis.set_xticks([c + 0.4 - width / 2 for c in range(len(columns))], columns)
    trace_axis.axhline(95, color="grey", linestyle="--", linewidth=1)
    trace_axis.set_ylabel("requests meeting both SLOs (%)")
    trace_axis.set_title("shifting trace")
    trace_axis.grid(alpha=0.3, axis="y")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="bench_goodput's --out (JSON)")
    parser.add_argument("out", help="the figure (PNG)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    plot(data["results"], data["settings"]["attainment"], args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
