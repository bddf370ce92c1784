"""Quantization methods: each keeps every token, as codes of fewer bits. One file per quantizer,
named as its registry name (`mlx_quant.py` is `mlx-quant`)."""
