"""Measurement and reporting: progress bars, metrics, log files."""
