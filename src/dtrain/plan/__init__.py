"""`dtrain plan`: predict the fastest layout of a job before running it.

- `source`: the model to plan for (bundled, --script, --factory);
- `calibrate`: the compute probe on the device, beside helper ranks (`busy`);
- `engine_probe`: the real loader and the Engine's own work per step;
- `weigh`: the model's bytes, FLOPs and per-layer shares; `overheads`: the wrappers' cost;
- `links`: seconds per collective by size, measured with `dtrain bench comm`;
- `machine`: cores, GPUs, memory per device, links between machines;
- `costs`: the formulas (ring all-reduce, overlap, bubble, ZeRO memory, PS, TP,
  gradient compression, local SGD);
- `layouts`: the candidate layouts, their flags, and dtrain's own checks on them;
- `inputs`: an estimate's terms and the figures they come from;
- `estimate` (data parallel, ps) and `model_parallel` (pipeline, tensor, hybrid): each
  layout's step time and memory from the above;
- `report` and `command`: the table, the explanation and `--json`.

Only `flags` is imported by `dtrain --help`; the rest imports torch.

A product: it enters the core through the public API and the doors
docs/architecture.md names (the strategy specs, the parallel core's splitters and plans,
the models and their recipes, batches, the sampler).
"""
