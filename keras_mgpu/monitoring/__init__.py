"""Samplers and backends for the monitors (NVML, TF memory info, psutil)."""
