"""The SLO planner: sizes the prefill and decode pools of a running deployment to its TTFT and ITL targets."""
