"""Measurement and reporting: progress bars, metrics, log files.

Measurement: it imports the leaves, `dtrain.config`, `dtrain.process` and `dtrain.step`;
it sees tensors and timings, never the strategies, models, parallel core or launcher that
produced them.
"""
