"""TAGC's compressed gradient exchange: which parameters travel compressed and how (policy), and
its use by the collective trainer (the ODC runtime compresses natively, csrc/odc + csrc/sketch)."""
from jaxodc.compress.policy import Compression, CompressionPlan, parse_compression, setting_of, tracking_plan

__all__ = ["Compression", "CompressionPlan", "parse_compression", "setting_of", "tracking_plan"]
