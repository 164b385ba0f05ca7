"""loadtest/bench_goodput.py's pure parts: the configurations of one worker budget and the table."""

from loadtest.bench_goodput import configurations, table


def test_every_static_split_of_the_budget_and_a_planner_of_the_same_budget():
    configs = configurations(4, 1500, 80, 2)
    assert list(configs) == ["colocated-x4", "1P-3D", "2P-2D", "3P-1D", "planner"]
    for name, flags in configs.items():
        if name.endswith("D"):
            prefill, decode = int(flags[flags.index("--prefill") + 1]), int(flags[flags.index("--decode") + 1])
            assert prefill + decode == 4 and name == f"{prefill}P-{decode}D"
    planner = configs["planner"]
    assert planner[planner.index("--planner-budget") + 1] == "4"
    assert planner[planner.index("--ttft-slo-ms") + 1] == "1500" and planner[planner.index("--itl-slo-ms") + 1] == "80"
    assert "--role-switch" in planner


def test_the_table_has_a_column_per_trace_phase_and_says_a_failed_configuration():
    result = {"sweep": {"max_rate": 2.0, "max_rate_interpolated": 2.4},
              "trace": {"slo_attainment": 0.955, "phases": {"prefill-heavy": {"slo_attainment": 1.0},
                                                            "decode-heavy": {"slo_attainment": 0.9}}}}
    lines = table({"1P-2D": result, "vllm-cpu": None}, 0.9).splitlines()
    assert lines[0].split("|")[5:7] == [" prefill-heavy ", " decode-heavy "]
    assert lines[2] == "| 1P-2D | 2 | 2.40 | 95.5% | 100% | 90% |"
    assert lines[3] == "| vllm-cpu | failed | - | - | - | - |"
