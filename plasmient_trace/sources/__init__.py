"""Capture sources: each turns what it sees into a records.RecordSet."""
