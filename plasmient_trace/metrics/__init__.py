"""Metrics: op cost models (flops.py), GPU/CPU peak tables (hardware.py) and the span metric arithmetic."""
