"""Coordination service: membership, votes, micro-consensus and abort propagation for the
fault-tolerant communicator. ``jaxodc master`` runs it standalone; ``Communicator(...,
host_master=True)`` embeds it in a peer."""
from jaxodc.coord.service import CoordinatorService, main

__all__ = ["CoordinatorService", "main"]
