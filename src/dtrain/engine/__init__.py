"""The Engine and its sides: what a training script holds after `dtrain.init()`.

`engine.py` is the Engine itself (setup, the step, backward, clipping, evaluate), built on
`job_view.py` (where this rank stands in the job), `data_side.py` (engine.dataloader and
engine.progress) and `checkpoint_side.py` (save, load, resume, done by `checkpoints.py`;
`own_states.py` carries what each rank trains apart from the others); `assembly.py`
builds and takes it apart, `evaluation.py` sums a test pass, `start.py` is `dtrain.init()`.

The loop: it imports every layer below it (config, process, step, data, observe,
checkpoint, parallel, strategies), never the launcher, the commands or the products.
"""

from dtrain.engine.engine import Engine

__all__ = ["Engine"]
