"""The one owner of model weights and forward passes.

``runner`` is ``ModelRunner`` (prefill, batched decode, the forward over the paged pool, its KV
pools) and ``backend`` the ``ModelBackend`` protocol it, ``StaticShapeRunner`` (``static_shapes``)
and the tests' fake satisfy; ``loader`` builds what a runner runs from a checkpoint (config checks,
weights, packing, quantization: ``quantize``, ``gguf``, ``compressed``; ``generation_defaults``
those it leaves unapplied); ``devices`` the device it runs on; ``decode_paths`` how a decode step
runs (chosen once); ``packed_step`` a whole engine step (prefill chunks and decode rows) as one
pass; ``buckets`` the fixed shapes graphs are made for; ``kv_cache`` the paged and
fixed KV caches, ``kv_pool`` the paged pool's K/V tensors and layout, ``block_pool`` its torch-free
block bookkeeping, ``blocks`` block arithmetic and ``prefix_cache`` the content keys of shared
blocks; ``attention`` batched attention over the pool; ``cuda_graphs`` captured decode steps;
``sampling`` choosing the next token; ``grammar`` constrained decoding; ``lora`` many LoRA adapters
on one base (the registry; ``lora_weights`` one adapter's weights, ``lora_bank`` their device
slots); ``threads`` the CPU thread count, measured, capped by ``cpu_quota`` (the cores a container
allows) and ``cpu_load`` (the cores other processes keep busy). ``cpu/`` holds our C++ CPU kernels (``cpu/csrc``) and
their Python faces.

May import: ``families`` and the top modules. Never ``engine``, ``state``, ``speculative``,
``serving`` or ``front``: a runner knows tensors, not sessions.
"""
