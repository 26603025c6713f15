"""The one owner of model weights and forward passes.

``runner`` is ``ModelRunner`` (load a checkpoint, prefill, batched decode) and ``backend`` the
``ModelBackend`` protocol it, ``StaticShapeRunner`` (``static_shapes``) and the tests' fake
satisfy; ``decode_paths`` how a decode step runs (chosen once); ``buckets`` the fixed shapes graphs
are made for; ``kv_cache`` the paged and fixed KV caches; ``attention`` batched attention over the pool;
``cuda_graphs`` captured decode steps; ``sampling`` choosing the next token; ``lora`` many LoRA
adapters on one base; ``threads`` the CPU thread count. ``cpu/`` holds our C++ CPU kernels
(``cpu/csrc``) and their Python faces.

May import: ``families`` and the top modules. Never ``engine``, ``state``, ``speculative``,
``serving`` or ``front``: a runner knows tensors, not sessions.
"""
