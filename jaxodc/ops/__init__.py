"""Thin JAX wrappers over jaxodc's FFI targets."""
from jaxodc.ops.attention import segment_attention
from jaxodc.ops.odc import odc_gather, odc_gather_into, odc_gather_pieces, odc_scatter_accumulate

__all__ = ["segment_attention", "odc_gather", "odc_gather_into", "odc_gather_pieces", "odc_scatter_accumulate"]
