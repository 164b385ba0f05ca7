"""Draw one request's trace as a waterfall (PNG), from the spans a Phoenix trace viewer stored.

    python -m loadtest.trace_waterfall --viewer http://127.0.0.1:6006 --trace-id ID --out trace.png

(The machine this project is built on has no browser to screenshot the viewer's
UI with; this draws the same spans, as the viewer's REST API returns them.)
"""

import argparse
import sys
from datetime import datetime

import httpx

SERVICE_OF_SPAN = (("gateway.", "gateway"), ("POST ", "gateway"), ("scheduler.", "scheduler"),
                   ("decode.", "decode"), ("prefill.", "prefill"), ("kvstore.lookup", "kvstore"),
                   ("kvstore.get", "kvstore"))
SHOWN_ATTRIBUTES = ("splitserve.worker", "splitserve.prefill", "splitserve.cached_blocks", "splitserve.ttft_s",
                    "splitserve.prefill_outcome", "splitserve.kv_transfer.backend", "splitserve.kv_transfer.bytes",
                    "splitserve.blocks_asked", "splitserve.blocks_held", "splitserve.outcome",
                    "splitserve.completion_tokens")


def fetch_spans(viewer: str, trace_id: str, project: str = "default", limit: int = 1000) -> list[dict]:
    spans, cursor = [], None
    while True:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{viewer.rstrip('/')}/v1/projects/{project}/spans", params=params, timeout=30).json()
        spans += [s for s in page["data"] if s["context"]["trace_id"] == trace_id]
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def _service(name: str, attributes: dict) -> str:
    for prefix, service in SERVICE_OF_SPAN:
        if name.startswith(prefix):
            return service
    return "kvstore client" if name.startswith("kvstore.") else "other"


def draw(spans: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_id = {s["context"]["span_id"]: s for s in spans}

    def depth(span) -> int:
        return 0 if not span.get("parent_id") or span["parent_id"] not in by_id else 1 + depth(by_id[span["parent_id"]])

    def when(text: str) -> float:
        return datetime.fromisoformat(text).timestamp()

    ordered = sorted(spans, key=lambda s: (when(s["start_time"]), depth(s)))
    origin = min(when(s["start_time"]) for s in spans)
    colors = {"gateway": "#4C72B0", "scheduler": "#DD8452", "decode": "#55A868", "prefill": "#C44E52",
              "kvstore": "#8172B3", "kvstore client": "#937860", "other": "#999999"}
    figure, axis = plt.subplots(figsize=(14, 0.55 * len(ordered) + 1.2))
    for row, span in enumerate(ordered):
        start, end = when(span["start_time"]) - origin, when(span["end_time"]) - origin
        attributes = span.get("attributes") or {}
        service = _service(span["name"], attributes)
        axis.barh(row, max((end - start) * 1000, 0.3), left=start * 1000, color=colors[service], height=0.6)
        shown = ", ".join(f"{k.removeprefix('splitserve.')}={attributes[k]:.3g}" if isinstance(attributes[k], float)
                          else f"{k.removeprefix('splitserve.')}={attributes[k]}"
                          for k in SHOWN_ATTRIBUTES if k in attributes)
        axis.text(end * 1000 + 1, row, f"{'  ' * depth(span)}{span['name']}  {(end - start) * 1000:.1f} ms  {shown}",
                  va="center", fontsize=8)
    axis.set_yticks([])
    axis.invert_yaxis()
    axis.set_xlabel("ms since the request arrived")
    axis.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for s, c in colors.items() if s != "other"]
    axis.legend(handles, [f"splitserve-{s}" if s != "kvstore client" else "kv-store client (in the worker)"
                          for s in colors if s != "other"], loc="lower right", fontsize=8)
    right = max(when(s["end_time"]) - origin for s in spans) * 1000
    axis.set_xlim(0, right * 1.9)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--viewer", default="http://127.0.0.1:6006")
    parser.add_argument("--trace-id", required=True)
    parser.add_argument("--project", default="default")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    spans = fetch_spans(args.viewer, args.trace_id, args.project)
    if not spans:
        print(f"no spans of trace {args.trace_id} at {args.viewer}", file=sys.stderr)
        return 1
    draw(spans, args.out, f"trace {args.trace_id}: {len(spans)} spans")
    print(f"wrote {args.out} ({len(spans)} spans)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
