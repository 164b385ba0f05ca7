"""The decode roofline's arithmetic: a step reads every weight and the KV so far; achieved bytes/s against the
device's peaks."""

import pytest

from loadtest.decode_roofline import roofline, step_bytes

MODEL = {"num_parameters": 1_000_000_000, "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64}


def test_a_step_reads_the_weights_and_the_kv_so_far():
    assert step_bytes(MODEL, "float32", 0) == 4e9
    assert step_bytes(MODEL, "bfloat16", 100) == 2e9 + 16 * 2 * 8 * 64 * 100 * 2


def test_achieved_bandwidth_as_a_share_of_each_peak():
    results = {"config": {"decode_prompt_len": 100, "decode_tokens": 200, "dtype": "float32", "device": "cuda"},
               "model": MODEL, "machine": {"device_name": "NVIDIA H200"},
               "decode_batch1": {"engine": {"ms_per_token": 1.0}, "transformers": {"ms_per_token": 2.0}}}
    report = roofline(results, copy_peak=4.0e12)
    nbytes = step_bytes(MODEL, "float32", 200)
    assert report["step_bytes"] == nbytes and report["datasheet_bytes_per_s"] == 4.8e12
    assert report["engine"]["bytes_per_s"] == pytest.approx(nbytes / 1e-3)
    assert report["engine"]["share_of_datasheet"] == pytest.approx(nbytes / 1e-3 / 4.8e12)
    assert report["transformers"]["share_of_copy"] == pytest.approx(nbytes / 2e-3 / 4.0e12)
    unknown = roofline({**results, "machine": {"device_name": "a CPU"}}, copy_peak=None)
    assert unknown["engine"]["share_of_datasheet"] is None and unknown["engine"]["share_of_copy"] is None
