"""The KV transfer benchmark runs end to end at a tiny size (no timing assertions)."""

import json

import pytest

pytestmark = pytest.mark.timeout(60)


def test_bench_transfer_tiny(tmp_path, capsys):
    from loadtest.bench_transfer import RESULT_KEYS, main

    output = tmp_path / "bench.json"
    rc = main(["--sizes", "64K,256K", "--repeats", "2", "--warmup", "1", "--checksum-bytes", "64K",
               "--output", str(output)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "shm GB/s" in printed and "shm-staged GB/s" in printed and "tcp GB/s" in printed and "tcp-tls GB/s" in printed

    results = json.loads(output.read_text())
    assert set(RESULT_KEYS) <= set(results)
    assert set(results["checksums"]["gbps"]) == {"memcpy", "fold64", "crc32", "blake2b"}
    assert [row["size"] for row in results["results"]] == [64 << 10, 256 << 10]
    for row in results["results"]:
        for side in ("memcpy", "shm", "shm-staged", "tcp", "tcp-tls"):
            assert row[side]["gbps"] > 0 and row[side]["latency_ms"] > 0
        for side in ("shm", "shm-staged", "tcp", "tcp-tls"):
            assert len(row[side]["latencies_ms"]) == 2 and row[side]["first_ms"] > 0
