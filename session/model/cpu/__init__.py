"""Our CPU kernels: C++ sources in ``csrc/`` compiled at start-up (``kernels``), and the
Python faces that call them: decode ``attention``, ``linear`` (bfloat16 and float32 tiles),
``packed_linear`` (oneDNN prepacking) and ``fused_layer`` (a whole decode step in one call).

Part of ``session.model``; the same rules apply.
"""
