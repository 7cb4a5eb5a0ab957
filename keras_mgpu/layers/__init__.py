"""Layers: the recompute-gradient wrapper and its model-level helpers."""
