"""Model parallelism building blocks: the dp x pp x tp mesh, stage splitting, tensor plans.

The strategies `pipeline`, `tensor` and `hybrid` (strategies/model_parallel.py) put these
together over `torch.distributed.pipelining` and DTensor tensor parallelism.
"""
