"""Stitching: joins record tables into the vertical span tree with deterministic ids."""
