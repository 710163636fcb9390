"""One-machine orchestration, above the services: it starts them as processes on loopback
ports and may import any of them (nothing under ``services/`` imports it, but the CLI).

- ``processes``: :class:`~services.local.processes.LocalPS` (PS shard processes, optionally
  supervised) and :class:`~services.local.processes.LocalLoader`
- ``supervise``: restart a process that dies (the local stand-in for a restart policy)
- ``train``: ``persimmon train`` (loaders, PS shards and gloo workers on this machine) and the
  planted data ``persimmon worker`` trains on without a loader
- ``demo``: ``persimmon demo``, the same end to end with a progress bar, a summary and curves
"""
