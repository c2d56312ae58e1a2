"""Strategies: what each is before any process starts (specs.py, the registry `--strategy`
looks names up in) and, one module each, what it does in a training process.

Above the parallel core: it imports the leaves, `dtrain.config`, `dtrain.process`,
`dtrain.step`, `dtrain.checkpoint` and `dtrain.parallel`, never the Engine or the
launcher; specs.py imports no torch.
"""
