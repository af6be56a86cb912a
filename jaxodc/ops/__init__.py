"""Thin JAX wrappers over jaxodc's FFI targets.

Communicating ops name their native object explicitly (`runtime=` / `endpoint`) and take and
return one ordering token type (`new_token()`: int32[1])."""
from jaxodc.ops._common import new_token
from jaxodc.ops.attention import segment_attention
from jaxodc.ops.odc import odc_gather, odc_gather_into, odc_gather_pieces, odc_scatter_accumulate
from jaxodc.ops.ring import all_reduce, all_reduce_tree

__all__ = ["segment_attention", "odc_gather", "odc_gather_into", "odc_gather_pieces", "odc_scatter_accumulate",
           "all_reduce", "all_reduce_tree", "new_token"]
