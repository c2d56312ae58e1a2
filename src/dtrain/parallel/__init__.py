"""Model parallelism building blocks: the dp x pp x tp mesh, stage splitting, tensor plans.

The strategies `pipeline`, `tensor` and `hybrid` (specs in strategies/specs.py) put these
together over `torch.distributed.pipelining` and DTensor tensor parallelism.

The parallel core: it imports the leaves, `dtrain.config`, `dtrain.process`,
`dtrain.step` and `dtrain.checkpoint`, never a strategy, the launcher or the Engine.
"""
