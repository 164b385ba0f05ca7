"""`splitserve ps`: the services of the deployment in a run directory."""

import argparse
import json
import sys

from services.cli.up import add_run_dir_option


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "ps",
        help="show the services of the running deployment",
        description="Read the deployment started by `splitserve up` and show each service: "
        "name, role, the model it serves, instance id, pid, state, restarts, CPUs (a pinned worker's, as it last "
        "acked them) and URL.",
    )
    add_run_dir_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def service_state(recorded: str, alive: bool, launcher_alive: bool) -> str:
    """What a service is doing now, from what the launcher last wrote and its pid.

    running / restarting / failed / starting / exited.
    """
    if launcher_alive and recorded in ("restarting", "failed"):
        return recorded
    if alive:
        return "running"
    if launcher_alive and recorded == "pending":
        return "starting"
    return "exited"


def deployment_state(recorded: str, launcher_alive: bool) -> str:
    if launcher_alive or recorded in ("stopped", "failed"):
        return recorded
    return "launcher gone"  # killed without a chance to stop its services


def snapshot(dep) -> dict:
    """deployment.json plus what is true now: `alive` and `state` per process."""
    launcher_alive = dep.launcher_alive()
    data = dep.to_dict()
    data["launcher_alive"] = launcher_alive
    data["state"] = deployment_state(dep.state, launcher_alive)
    data["recorded_state"] = dep.state
    for rec, out in zip(dep.services, data["services"]):
        alive = rec.alive()
        out["alive"] = alive
        out["recorded_state"] = rec.state
        out["state"] = service_state(rec.state, alive, launcher_alive)
    first = dep.models[0].name if dep.models else None  # (a deployment.json of before several models: none)
    data["pools"] = pools(dep.desired, [s for s in data["services"] if s.get("model") in (first, None)])
    for model in data["models"][1:]:
        model["pools"] = pools(model["desired"], [s for s in data["services"] if s.get("model") == model["name"]])
    if dep.nats is not None:
        alive = dep.nats.alive()
        data["nats"]["alive"] = alive
        if dep.nats.embedded:
            data["nats"]["state"] = "running" if alive else "exited"
        else:
            data["nats"]["state"] = "external"
        for node, out in zip(dep.nats.nodes, data["nats"]["nodes"]):
            out["alive"] = node.alive()
            out["state"] = "running" if out["alive"] else "exited"
    return data


def pools(desired: dict[str, int], services: list[dict]) -> dict[str, dict[str, int]]:
    """Per scalable pool: its size asked for (`splitserve scale`), its workers running, and those retiring
    (draining before they exit)."""
    out = {role: {"desired": n, "running": 0, "retiring": 0} for role, n in desired.items()}
    for s in services:
        if s["role"] in out and s["state"] == "running":
            out[s["role"]]["retiring" if s["recorded_state"] == "stopping" else "running"] += 1
    return out


def pools_line(pools: dict[str, dict[str, int]]) -> str | None:
    """"pools (running/desired): decode 2/2, prefill 1/1 (1 retiring)"; None without scalable pools."""
    if not pools:
        return None
    parts = [f"{role} {p['running']}/{p['desired']}" + (f" ({p['retiring']} retiring)" if p["retiring"] else "")
             for role, p in pools.items()]
    return "pools (running/desired): " + ", ".join(parts)


def format_table(data: dict) -> str:
    launcher = f"launcher pid {data.get('launcher_pid')}" + ("" if data["launcher_alive"] else ", not running")
    lines = [
        f"deployment in {data['run_dir']}: {data['state']} ({launcher})",
        f"model {data.get('served_model_name')}, topology {data.get('topology')}, namespace {data.get('namespace')}, "
        f"api {data.get('api_url')}",
    ]
    if pools_line(data.get("pools") or {}):
        lines.append(pools_line(data["pools"]))
    for model in (data.get("models") or [])[1:]:
        line = pools_line(model.get("pools") or {})
        lines.append(f"model {model['name']}, {model['state']}, namespace {model['namespace']}"
                     + (f"; {line}" if line else ""))
    if data.get("message"):
        lines.append(f"last error: {data['message']}")
    rows = [("NAME", "ROLE", "MODEL", "INSTANCE", "PID", "STATE", "RESTARTS", "CPUS", "URL")]
    nats = data.get("nats")
    if nats:
        nodes = nats.get("nodes") or []
        first_url = (nats.get("url") or "-").split(",")[0] if nodes else nats.get("url") or "-"
        rows.append(("nats-0" if nodes else "nats", "nats", "-", "-",
                     str(nats.get("pid") or "-") if nats["embedded"] else "-", nats["state"],
                     str(nats.get("restarts", 0)), "-", first_url))
        for node in nodes:
            rows.append((node["name"], "nats", "-", "-", str(node.get("pid") or "-"), node["state"],
                         str(node.get("restarts", 0)), "-", node["url"]))
    for s in data["services"]:
        rows.append((s["name"], s["role"], s.get("model") or "-", s["instance_id"], str(s.get("pid") or "-"),
                     s["state"], str(s.get("restarts", 0)), s.get("cpus") or "-", s.get("url") or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from services.launcher.deployment import DeploymentError, read_deployment, resolve_run_dir

    run_dir = resolve_run_dir(args.run_dir)
    try:
        dep = read_deployment(run_dir)
    except DeploymentError as exc:
        print(f"splitserve ps: error: {exc}", file=sys.stderr)
        return 1
    if dep is None:
        print(f"splitserve ps: no deployment in {run_dir} (start one with `splitserve up`, or pass --run-dir)", file=sys.stderr)
        return 1
    data = snapshot(dep)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_table(data))
    return 0
