"""`splitserve bench`'s client: a load generator for any OpenAI-compatible server (`serve`), its workloads
(`datasets`) and figures (`metrics`), and `compare`, which runs one workload against topologies started in turn
(`up_process`). The benchmarks in loadtest/ build on it."""
