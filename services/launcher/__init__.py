"""The one-machine launcher behind `splitserve up`.

- `nats_server.EmbeddedNats`: a private `nats-server` with JetStream.
- `supervisor.Supervisor`: supervised child processes (restart with backoff,
  clean stop of whole process groups).
- `deployment`: the run directory's `deployment.json` and its lock.
- `topology`: which services a topology runs, with which flags.
- `launcher.Launcher`: puts it together (what `splitserve up` runs).

Nothing here imports torch or the services, so `splitserve --help`, `ps` and
the launcher's own tests stay fast.
"""
