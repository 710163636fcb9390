"""A free TCP port, for whatever binds one a moment later (a child service's ports, the
torch.distributed rendezvous): the one place this is done."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may take it
    before the caller binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
