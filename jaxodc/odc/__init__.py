"""ODC runtime: shard store lifecycle, unit layout and the minibatch protocol."""
from jaxodc.odc.runtime import (LayoutMismatchError, Link, OdcError, OdcTimeoutError, PeerError, Runtime,
                                check_layouts)

__all__ = ["Runtime", "Link", "OdcError", "OdcTimeoutError", "PeerError", "LayoutMismatchError", "check_layouts"]
