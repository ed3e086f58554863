"""Experiment pipeline: configs -> evaluations -> JSONL records -> reports."""
