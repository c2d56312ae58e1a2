"""The data side below the Engine: the sampler that splits each global batch over the
data-parallel ranks, streams (iterable data sets read once per epoch over every rank and
worker), the resumable loader `engine.dataloader` returns, and shard files (read in
partitions, shared over a rank's workers, written in one rename).

Beside the measurement and file formats: it imports the leaves, `dtrain.step` (the
training position) and `dtrain.checkpoint` (atomic writes), and torch.
"""
