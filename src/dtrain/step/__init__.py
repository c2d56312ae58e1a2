"""The step's own pieces, which every strategy shares: batches (their shapes, how the model
is called on one, how they are cut and how much each share weighs), precision (autocast and
fp16's loss scaling), optimizers (what a step asks of one) and the training position (which
step, epoch and sample the run stands at).

A foundation: it imports only the leaves (`dtrain.errors`) and torch.
"""
