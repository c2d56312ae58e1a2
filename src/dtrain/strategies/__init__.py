"""Strategies: what each is before any process starts (specs.py, the registry `--strategy`
looks names up in) and, one module each, what it does in a training process."""
