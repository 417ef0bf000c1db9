"""Attention kernels of the decode step: paged decode attention for grouped-query heads in one
launch (decode.py). Imports moe_serve.kernels.fused and moe_serve.kernels.moe's launch helpers,
nothing from moe_serve.kernels.plugin or moe_serve.kernels.models."""
