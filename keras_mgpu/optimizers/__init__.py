"""Optimizer wrappers: gradient accumulation under any strategy."""
