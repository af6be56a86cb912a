"""Thin JAX wrappers over jaxodc's FFI targets."""
from jaxodc.ops.odc import odc_gather, odc_gather_into, odc_scatter_accumulate

__all__ = ["odc_gather", "odc_gather_into", "odc_scatter_accumulate"]
