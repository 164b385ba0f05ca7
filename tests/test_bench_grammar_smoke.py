"""The structured output benchmark runs end to end at tiny size (no timing assertions)."""

import json

from loadtest.bench_grammar import main


def test_bench_grammar_both_parts_on_the_test_model(default_model, tmp_path):
    output = tmp_path / "grammar.json"
    assert main(["--part", "backends", "--tokenizer", default_model, "--repeats", "1", "--output", str(output)]) == 0
    assert main(["--part", "engine", "--model", default_model, "--batch", "2", "--tokens", "8",
                 "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    llguidance = results["backends"]["libraries"]["llguidance"]
    assert set(llguidance["cases"]) == {"json_schema", "json_object", "regex"}
    assert all(case["valid_output_allowed"] and case["mask_fill"]["n"] == case["tokens"]
               for case in llguidance["cases"].values())
    engine = results["engine"]
    assert engine["free"]["decode_steps"] > 0 and engine["constrained"]["decode_steps"] == engine["free"]["decode_steps"]
