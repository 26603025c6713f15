"""What a model family is: one registry entry per ``model_type``.

``registry`` names, for each family, its Hugging Face class, how its processor is built, how many
tokens an image becomes and its position scheme; ``support`` refuses what the engine does not
implement. The family-specific details live beside it: ``vision`` (images as a family sees them),
``anyres`` (LLaVA-NeXT's tiling), ``qwen_vl`` and ``mrope`` (Qwen2-VL's geometry and positions),
``image_decode`` (request images decoded safely: limits, bombs, digests).

May import: the top modules only (and transformers). Never another layer.
"""
