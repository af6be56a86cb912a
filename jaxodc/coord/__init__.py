"""Coordination service of the fault-tolerant communicator: membership, votes, micro-consensus and
abort propagation. `protocol` (wire format, message table), `state` (the state machine, no I/O),
`service` (its asyncio transport), `topology` (ring order from measured bandwidth). docs/coord.md
describes the protocol."""
import importlib

__all__ = ["CoordinatorService", "main"]


def __getattr__(name: str):
    # Lazy, so that importing jaxodc.coord.protocol (the rendezvous does) stays light.
    if name in __all__:
        return getattr(importlib.import_module("jaxodc.coord.service"), name)
    raise AttributeError(f"module 'jaxodc.coord' has no attribute {name!r}")
