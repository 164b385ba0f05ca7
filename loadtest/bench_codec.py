"""What a message costs on the event loop: encode and decode time per message size, for the contracts' codec.

    python -m loadtest.bench_codec [--out FILE.json]

GenerateRequest with prompts of 16 to 32k tokens (the largest message every request sends), and a TokenChunk
(the most frequent one). Each figure is the median of `--repeats` timings of `--number` calls.
"""

import argparse
import json
import statistics
import time

from contracts import GenerateRequest, TokenChunk
from shared.engine.sampling_params import SamplingParams


def _time_us(fn, number: int, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - started) / number * 1e6)
    return statistics.median(runs)


def samples() -> list[tuple[str, object]]:
    out = []
    for num_tokens in (16, 1024, 8192, 32768):
        out.append((f"GenerateRequest, {num_tokens} prompt tokens", GenerateRequest(
            request_id="cmpl-" + "0" * 32, model="smollm2-135m-instruct", prompt_token_ids=list(range(num_tokens)),
            sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=3), reply_subject="a.b.tokens.gw.r",
            deadline_ms=1, created_ms=2)))
    out.append(("TokenChunk, 1 token", TokenChunk(request_id="cmpl-" + "0" * 32, seq=7, token_ids=[1234], text=" the",
                                                  prompt_tokens=128, completion_tokens=8)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    rows = []
    for name, message in samples():
        data = message.encode()
        number = max(1, args.number * 100 // max(1, len(data) // 1000 or 1))
        rows.append({"message": name, "bytes": len(data),
                     "encode_us": round(_time_us(message.encode, number, args.repeats), 2),
                     "decode_us": round(_time_us(lambda: type(message).decode(data), number, args.repeats), 2)})
    print("| message | bytes | encode | decode |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['message']} | {row['bytes']:,} | {row['encode_us']:,} us | {row['decode_us']:,} us |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
