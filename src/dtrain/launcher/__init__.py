"""The launcher: `dtrain run` and `dtrain demo` start a job's workers on PyTorch's elastic
agent (one machine, many over ssh, or those a scheduler allocated), watch them, and turn a
failure into one paragraph per rank; `dtrain.launch` forks ranks from a notebook.

Beside the loop: it imports the config, the process, the strategy specs and the
checkpoint's --out lock, never the Engine (`dtrain.engine`), the parallel core or the
models; a strategy reaches it only through its spec.
"""
