"""A listening socket bound to one address, for a TCPStore's server (the agents' store and the
ranks' store alike): torch's own server would listen on every interface."""

from __future__ import annotations

import socket

from slurmkit.errors import SlurmkitError

__all__ = ["listen_socket"]


def listen_socket(addr: str, backlog: int = 1024, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``addr`` (``port``, or a free one), for a store's server.
    ``backlog``: connections the kernel queues before the server accepts them (every agent
    connects at once, several times; the kernel caps it at net.core.somaxconn)."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SlurmkitError(
            f"Detected: cannot resolve node 0's address {addr!r} ({exc}). Requirement: the address "
            "the nodes use to reach node 0 (SLURM_LAUNCH_NODE_IPADDR). Fix: check the node's name "
            "resolution, or the cluster's network settings.") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((sockaddr[0], port))
    except OSError as exc:
        sock.close()
        raise SlurmkitError(
            f"Detected: cannot listen on {addr}:{port or 'a free port'} ({exc}). Requirement: "
            "an address of this host that the other nodes reach (and a free port). Fix: check "
            "SLURM_LAUNCH_NODE_IPADDR on the batch host (the ranks' MASTER_ADDR).") from None
    sock.listen(backlog)
    return sock
