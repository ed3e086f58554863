"""Evaluation and calibration text."""
