"""GGUF tensors decoded by kvcompress/fromgguf/reader.py: equal to ggml's `gguf` reference and to
hand-built llama.cpp blocks; and what MLX's own `mx.load` does with the same files."""

import kvcompress  # noqa: F401  (preloads OpenBLAS before mlx)

import gguf
import mlx.core as mx
import numpy as np
import pytest

from gguf_files import Q, encode, write_file
from kvcompress.errors import ConfigError
from kvcompress.fromgguf.reader import GGUFFile

ROWS, COLS = 8, 512


def fp16_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.float16(value).tobytes(), np.uint8)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0, Q.Q4_1, Q.F16])
def test_tensor_types_decode_as_gguf_reference(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.02
    data = values if qtype == Q.F16 else encode(values, qtype, rng)
    reference = write_file(tmp_path / "t.gguf", "llama", {"w": (data, qtype)}, pre=None)["w"]
    decoded = GGUFFile(tmp_path / "t.gguf").dequantize("w")
    assert decoded.shape == (ROWS, COLS) and decoded.dtype == np.float32
    assert np.array_equal(decoded, reference)
    # quantized from `values`: within the quantizer's error bound, a fraction of the largest |value|
    # (half a code step; Q5_0's top code is clipped, so a whole step there), not garbage
    bound = {Q.Q8_0: 0.5 / 127, Q.Q5_0: 1 / 16, Q.Q4_1: 1 / 15, Q.F16: 1 / 2048}
    if qtype in bound:
        assert np.abs(decoded - values).max() <= bound[qtype] * np.abs(values).max() * 1.01


def test_q4_k_block_by_hand(tmp_path):
    """llama.cpp's block_q4_K: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles (32-value sub-blocks 2p and 2p+1 in the low and high nibbles of bytes 32p..32p+31);
    y = d * scale_j * q - dmin * min_j (ggml-quants.c, dequantize_row_q4_K)."""
    d, dmin = 0.5, 0.25
    scales, mins = np.arange(1, 9), np.arange(0, 8)  # j >= 4 below 16: their high bits are zero
    packed = np.zeros(12, np.uint8)
    packed[0:4], packed[4:8] = scales[:4], mins[:4]
    packed[8:12] = (scales[4:] & 0xF) | ((mins[4:] & 0xF) << 4)
    q = (np.arange(8)[:, None] + np.arange(32)[None, :]) % 16  # q[j, l] of sub-block j
    nibbles = np.concatenate([q[2 * p] | (q[2 * p + 1] << 4) for p in range(4)]).astype(np.uint8)
    block = np.concatenate([fp16_bytes(d), fp16_bytes(dmin), packed, nibbles])[None, :]
    write_file(tmp_path / "t.gguf", "llama", {"w": (block, Q.Q4_K)}, pre=None)
    expected = (d * scales[:, None] * q - dmin * mins[:, None]).reshape(1, 256)
    assert np.array_equal(GGUFFile(tmp_path / "t.gguf").dequantize("w"), expected.astype(np.float32))


def test_q6_k_block_by_hand(tmp_path):
    """llama.cpp's block_q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales
    (one per 16 values), fp16 d; y = d * scale_i * (q - 32). Low nibbles 15 and high bits 0 give
    q - 32 = -17 where the value takes the byte's low nibble and -32 where it takes the high one."""
    d, scales = 0.5, np.arange(1, 17, dtype=np.int8)
    ql, qh = np.full(128, 0x0F, np.uint8), np.zeros(64, np.uint8)
    block = np.concatenate([ql, qh, scales.view(np.uint8), fp16_bytes(d)])[None, :]
    write_file(tmp_path / "t.gguf", "llama", {"w": (block, Q.Q6_K)}, pre=None)
    # per 128-value half: values 0-63 read low nibbles (bytes l and l+32), 64-127 high nibbles
    q = np.tile(np.concatenate([np.full(64, -17), np.full(64, -32)]), 2)
    expected = d * np.repeat(scales.astype(np.float32), 16) * q
    assert np.array_equal(GGUFFile(tmp_path / "t.gguf").dequantize("w"), expected[None, :].astype(np.float32))


def test_unreadable_tensor_type_is_a_config_error(tmp_path):
    blocks = np.zeros((1, gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)
    write_file(tmp_path / "t.gguf", "llama", {"w": (blocks, Q.Q8_1)}, pre=None)
    with pytest.raises(ConfigError, match=r"w: tensor type Q8_1 cannot be dequantized.*'Q4_K'"):
        GGUFFile(tmp_path / "t.gguf").check_readable()
    with pytest.raises(ConfigError, match="expected a readable GGUF file"):
        (tmp_path / "not.gguf").write_bytes(b"not a gguf file at all")
        GGUFFile(tmp_path / "not.gguf")


def test_mx_load_still_misdecodes_q4_k(tmp_path):
    """MLX 0.32.4's `mx.load` (its bundled gguflib) decodes Q4_K wrongly and refuses Q5_0, while Q6_K
    is right: kvcompress dequantizes with `gguf` instead. When this test fails, MLX reads these types
    right and a fixed MLX can be adopted for GGUF loading (and this assertion flipped)."""
    rng = np.random.default_rng(0)
    errors = {}
    for qtype in (Q.Q4_K, Q.Q6_K):
        path = tmp_path / f"{qtype.name}.gguf"
        reference = write_file(path, "llama", {"w": (encode(np.zeros((ROWS, COLS)), qtype, rng), qtype)}, pre=None)["w"]
        loaded = np.array(mx.load(str(path))["w"].astype(mx.float32))
        errors[qtype.name] = float(np.abs(loaded - reference).max() / reference.std())
    assert errors["Q6_K"] < 0.01, f"mx.load decodes Q6_K within fp16 rounding: {errors}"
    assert errors["Q4_K"] > 0.5, (f"mx.load now decodes Q4_K right ({errors}, max error / std): a fixed MLX can be "
                                  f"adopted; update this test and kvcompress/fromgguf/reader.py's docstring")
    path = tmp_path / "q5_0.gguf"
    write_file(path, "llama", {"w": (encode(rng.standard_normal((ROWS, COLS)), Q.Q5_0, rng), Q.Q5_0)}, pre=None)
    with pytest.raises(RuntimeError, match="gguf_tensor_to_f16 failed"):
        mx.load(str(path))
