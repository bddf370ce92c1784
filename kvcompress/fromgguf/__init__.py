"""GGUF files (llama.cpp's format) as mlx-lm models.

`reader.py` opens a file with ggml's own `gguf` package and dequantizes its tensors;
`architectures.py` maps a `general.architecture` to an mlx-lm model (its config from the metadata,
its tensor names, llama.cpp's q/k row permutation undone where llama.cpp applies it);
`tokenizer.py` rebuilds the tokenizer from the metadata; `convert.py` writes the result once as a
plain mlx-lm model directory in the cache and loads it from there (no `gguf` needed then).
"""
