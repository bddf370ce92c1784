"""TurboQuant (Zandieh et al., ICLR 2026, arXiv:2504.19874): random rotation, Lloyd-Max scalar codes
and a 1-bit QJL residual, stored packed.

A key or value x [D] is stored as its norm and the codes of u = Pi x / ||x||, Pi a random orthogonal
matrix (seeded, one per KV head). After the rotation each coordinate of a unit vector follows the
same known density, f(t) ~ (1 - t^2)^((D - 3) / 2) on [-1, 1] (variance 1/D), so one scalar
Lloyd-Max codebook for that density, computed once per (D, bits), is the optimal per-coordinate
quantizer (the paper's TurboQuant_mse):
- values: `value_bits`-bit codes per coordinate (TurboQuant_mse);
- keys: TurboQuant_prod, for an unbiased inner product with the query: (`key_bits` - 1)-bit codes,
  then the residual r = u - c[codes] stored as ||r|| and the signs of S r (S a seeded Gaussian
  D x D matrix, the 1-bit QJL transform), so that
      <q, k> ~= ||k|| (<Pi q, c[codes]> + sqrt(pi / 2) / D * ||r|| <S Pi q, sign(S r)>);
  `qjl=False` stores keys as `key_bits`-bit codes instead (TurboQuant_mse: a lower error, but the
  inner product is biased toward zero; on the embedded model its scores vary far less with the seed).
Attention runs on the codes: the query is rotated (and sketched) once, scores come from the
codebook entries of the codes, and the value side's weighted sum is taken in the rotated space and
rotated back once. The tokens of the current call (a prompt chunk, a decode step's token) attend to
each other exactly, as KIVI's full-precision residual does; their codes serve every later call. This module is the plain MLX reference (no fused kernel yet); it gathers the
codebook entries of the held codes per step, a transient, not a stored copy. `live_kv_bytes` is
the packed codes, signs and norms held.

Departures: integer bit widths only (2, 3, 4 per side); the paper's and mlx-vlm's fractional widths
(2.5, 3.5: outlier channels at one bit more) are not built. Every token is stored quantized when it
arrives (no full-precision window beyond the current call). Norms are kept in float16.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np

from ..attention import install
from ..errors import ConfigError, check
from .base import CompressedCache, Method, PerSideBits, array_bytes

BITS = (2, 3, 4)
ROWS_STEP = 256  # token rows allocated at a time, as mlx-lm's KVCache


@dataclass(frozen=True)
class TurboQuant(PerSideBits, Method):
    """TurboQuant: rotated Lloyd-Max codes per coordinate; keys add a 1-bit QJL residual.

    bits: bits per coordinate for keys and values (2, 3, 4); key_bits / value_bits override it per
    side. Keys spend one of their bits on the QJL sign sketch (the paper's TurboQuant_prod); with
    qjl=False they spend all on codes (TurboQuant_mse: lower error, biased inner products).
    seed: the rotations and the sketch.
    """

    name = "turboquant"
    stores_quantized = True  # an eviction method's `quantize` may name it (methods/composed.py)
    bits: int = 4
    key_bits: int | None = None
    value_bits: int | None = None
    qjl: bool = True
    seed: int = 0

    def __post_init__(self):
        allowed = "one of " + ", ".join(map(str, BITS)) + " (fractional widths are not built)"
        check(self.bits in BITS, "turboquant.bits", allowed, self.bits)
        check(self.key_bits is None or self.key_bits in BITS, "turboquant.key_bits", allowed + " or None", self.key_bits)
        check(self.value_bits is None or self.value_bits in BITS, "turboquant.value_bits", allowed + " or None",
              self.value_bits)
        check(isinstance(self.seed, int), "turboquant.seed", "an int", self.seed)
        check(isinstance(self.qjl, bool), "turboquant.qjl", "true or false", self.qjl)

    def make_cache(self, model) -> list:
        install()  # the caches attend over their codes themselves
        return super().make_cache(model)

    def layer_cache(self, layer, i, n, layout):
        if layer.head_dim % 32 or layer.value_dim % 32:
            raise ConfigError(f"turboquant: key and value dims must be multiples of 32 (codes are packed in 32-bit "
                              f"words); {layout.model_class} has {layer.head_dim} and {layer.value_dim}")
        return self.new_cache(i)

    def new_cache(self, i: int) -> "TurboQuantCache":
        """An empty cache for the i-th compressed layer (its own rotations: the seed and i)."""
        return TurboQuantCache(self.k_bits, self.v_bits, self.seed * 100_003 + i, self.qjl)


# -- the quantizer ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def codebook(dim: int, bits: int) -> np.ndarray:
    """The Lloyd-Max centroids [2^bits] (ascending) for one coordinate of a uniformly random unit
    vector in `dim` dimensions: density ~ (1 - t^2)^((dim - 3) / 2). Lloyd's iterations on a fine
    grid of the density, from the Gaussian's quantiles; float64."""
    t = np.linspace(-1.0, 1.0, 50_001)[1:-1]
    density = np.exp((dim - 3) / 2 * np.log1p(-t * t))
    cdf = np.cumsum(density)
    cdf /= cdf[-1]
    levels = 2**bits
    centroids = np.interp((np.arange(levels) + 0.5) / levels, cdf, t)
    for _ in range(300):
        edges = np.concatenate([[-1.0], (centroids[1:] + centroids[:-1]) / 2, [1.0]])
        cell = np.searchsorted(edges, t) - 1
        mass = np.bincount(cell, weights=density, minlength=levels)
        moment = np.bincount(cell, weights=density * t, minlength=levels)
        updated = moment / mass
        if np.max(np.abs(updated - centroids)) < 1e-12:
            break
        centroids = updated
    return (centroids - centroids[::-1]) / 2  # the density is even: exactly symmetric


def random_rotation(heads: int, dim: int, seed: int) -> mx.array:
    """[heads, dim, dim] random orthogonal matrices: QR of seeded Gaussians, signs fixed (Haar)."""
    rng = np.random.default_rng(seed)
    out = np.empty((heads, dim, dim), np.float32)
    for h in range(heads):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        out[h] = q * np.sign(np.diag(r))[None]
    return mx.array(out)


def sketch_matrix(heads: int, dim: int, seed: int) -> mx.array:
    """[heads, dim, dim] the QJL transform S: i.i.d. standard Gaussians, seeded."""
    return mx.array(np.random.default_rng(seed + 1).standard_normal((heads, dim, dim)).astype(np.float32))


def pack(codes: mx.array, bits: int) -> mx.array:
    """codes [..., D] (ints < 2^bits) -> [..., D * bits / 32] uint32, a little-endian bit stream."""
    shifts = mx.arange(bits, dtype=mx.uint32)
    stream = (codes.astype(mx.uint32)[..., None] >> shifts) & 1  # [..., D, bits]
    stream = stream.reshape(*codes.shape[:-1], -1, 32)  # [..., W, 32]
    return (stream << mx.arange(32, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int, dim: int) -> mx.array:
    """The inverse of `pack`: [..., W] uint32 -> codes [..., dim] uint32."""
    stream = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1  # [..., W, 32]
    stream = stream.reshape(*words.shape[:-1], dim, bits)
    return (stream << mx.arange(bits, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def nearest(u: mx.array, centroids: mx.array) -> mx.array:
    """Index of the nearest centroid (ascending) for each coordinate of u."""
    edges = (centroids[1:] + centroids[:-1]) / 2
    return (u[..., None] > edges).sum(axis=-1).astype(mx.uint32)


class TurboQuantCache(CompressedCache):
    """One layer's TurboQuant storage (see the module docstring); tokens in order, all quantized.

    keys:   codes [B, H, cap, D*(kb-1)/32] uint32, norms [B, H, cap] f16, signs [B, H, cap, D/32]
            uint32, residual norms [B, H, cap] f16
    values: codes [B, H, cap, D*vb/32] uint32, norms [B, H, cap] f16
    The first `offset` rows are in use (rows are allocated ROWS_STEP at a time).
    """

    def __init__(self, key_bits: int = 4, value_bits: int = 4, seed: int = 0, qjl: bool = True):
        self.key_bits, self.value_bits, self.seed, self.qjl = key_bits, value_bits, seed, qjl
        self.arrays = None  # dict name -> buffer
        self.offset = 0
        self.dims = None  # (H, D_k, D_v)
        self._fresh = None  # (keys, values) of the tokens of the current call, until its attention

    # an mx.Dtype cannot be pickled, so copy.deepcopy (the runner copies a compressed context for each
    # of its uses) could not copy a cache holding one: the cache keeps the dtype's name
    @property
    def dtype(self) -> mx.Dtype:
        return getattr(mx, self._dtype_name)

    @dtype.setter
    def dtype(self, value: mx.Dtype) -> None:
        self._dtype_name = str(value).rsplit(".", 1)[-1]

    # -- quantization ---------------------------------------------------------------------------

    def _setup(self, H: int, Dk: int, Dv: int):
        self.dims = (H, Dk, Dv)
        self.dtype = mx.float16  # what attention returns when the first keys' dtype is not known (a load)
        self.rot_k = random_rotation(H, Dk, self.seed)
        self.rot_v = random_rotation(H, Dv, self.seed + 7)
        self.sketch = sketch_matrix(H, Dk, self.seed)
        self.code_bits = self.key_bits - 1 if self.qjl else self.key_bits  # keys' bits a coordinate
        self.cb_k = mx.array(codebook(Dk, self.code_bits).astype(np.float32))
        self.cb_v = mx.array(codebook(Dv, self.value_bits).astype(np.float32))

    def quantize(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        """keys [B, H, S, Dk], values [B, H, S, Dv] -> the stored arrays of S tokens."""
        k = keys.astype(mx.float32)
        k_norm = mx.sqrt((k * k).sum(-1, keepdims=True))
        u = (k / mx.maximum(k_norm, 1e-30)) @ self.rot_k.swapaxes(-1, -2)[None]  # Pi k / ||k||  [B, H, S, Dk]
        k_codes = nearest(u, self.cb_k)
        v = values.astype(mx.float32)
        v_norm = mx.sqrt((v * v).sum(-1, keepdims=True))
        v_codes = nearest((v / mx.maximum(v_norm, 1e-30)) @ self.rot_v.swapaxes(-1, -2)[None], self.cb_v)
        stored = {
            "k_codes": pack(k_codes, self.code_bits), "k_norms": k_norm[..., 0].astype(mx.float16),
            "v_codes": pack(v_codes, self.value_bits), "v_norms": v_norm[..., 0].astype(mx.float16),
        }
        if self.qjl:
            r = u - self.cb_k[k_codes]
            signs = ((r @ self.sketch.swapaxes(-1, -2)[None]) >= 0).astype(mx.uint32)  # sign(S r) as bits
            stored.update(k_signs=pack(signs, 1), k_res_norms=mx.sqrt((r * r).sum(-1)).astype(mx.float16))
        return stored

    # -- mlx-lm protocol ------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys [B, H, S, Dk], values [B, H, S, Dv] post-RoPE
        if self.dims is None:
            self._setup(keys.shape[1], keys.shape[3], values.shape[3])
        # update_and_fetch hands the model this cache as its keys and values; a model that reads
        # their dtype (Phi-2 casts its attention output to it) gets the activations'
        self.dtype = values.dtype
        new = self.quantize(keys, values)
        start, end = self.offset, self.offset + keys.shape[2]
        self._fresh = (keys, values)  # this call's own tokens, which its queries see exactly
        if self.arrays is None or end > self.arrays["k_norms"].shape[2]:
            grow = -(-(end - start) // ROWS_STEP) * ROWS_STEP
            self.arrays = {
                name: mx.concatenate([self.arrays[name][:, :, :start], mx.zeros((*a.shape[:2], grow, *a.shape[3:]), a.dtype)],
                                     axis=2) if self.arrays is not None
                else mx.zeros((*a.shape[:2], grow, *a.shape[3:]), a.dtype)
                for name, a in new.items()
            }
        for name, a in new.items():
            self.arrays[name][:, :, start:end] = a
        self.offset = end
        return self, self  # attention reads the codes from the cache itself

    def _used(self) -> dict[str, mx.array]:
        return {name: a[:, :, : self.offset] for name, a in self.arrays.items()}

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        """Softmax attention of queries [B, H_q, L, Dk] over the held tokens, on the codes."""
        B, n_q, L, Dk = queries.shape
        H, _, Dv = self.dims
        G, T = n_q // H, self.offset
        # the tokens stored before this call attend through their codes; the call's own S tokens
        # (a prompt chunk, or a decode step's token) exactly, as KIVI's residual: their codes are
        # stored for the queries of later calls
        fresh_k, fresh_v = self._fresh if self._fresh is not None else (None, None)
        self._fresh = None
        S = 0 if fresh_k is None else fresh_k.shape[2]
        a = {name: x[:, :, : T - S] for name, x in self.arrays.items()}
        q = queries.astype(mx.float32).reshape(B, H, G * L, Dk)
        q_rot = q @ self.rot_k.swapaxes(-1, -2)[None]  # Pi q  [B, H, G*L, Dk]
        centroids = self.cb_k[unpack(a["k_codes"], self.code_bits, Dk)]  # [B, H, T - S, Dk]
        scores = q_rot @ centroids.swapaxes(-1, -2)
        if self.qjl:
            q_sketch = q_rot @ self.sketch.swapaxes(-1, -2)[None]  # S Pi q
            signs = unpack(a["k_signs"], 1, Dk).astype(mx.float32) * 2 - 1  # [B, H, T - S, Dk]
            qjl = math.sqrt(math.pi / 2) / Dk * a["k_res_norms"].astype(mx.float32)[:, :, None]  # [B, H, 1, T - S]
            scores = scores + qjl * (q_sketch @ signs.swapaxes(-1, -2))
        scores = scores * a["k_norms"].astype(mx.float32)[:, :, None]  # [B, H, G*L, T - S]
        if S:
            scores = mx.concatenate([scores, q @ fresh_k.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
        scores = (scores * scale).reshape(B, n_q, L, T)
        if isinstance(mask, str):
            mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
        if mask is not None:
            scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
        if sinks is not None:  # one extra logit per query head in the softmax, to no value
            sink = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (B, n_q, L, 1))
            probs = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1, precise=True)[..., :-1]
        else:
            probs = mx.softmax(scores, axis=-1, precise=True)
        probs = probs.reshape(B, H, G * L, T)
        weights = probs[..., : T - S] * a["v_norms"].astype(mx.float32)[:, :, None]
        v_rot = self.cb_v[unpack(a["v_codes"], self.value_bits, Dv)]  # [B, H, T - S, Dv] rotated unit values
        out = (weights @ v_rot) @ self.rot_v[None]  # summed in the rotated space, then Pi^T once
        if S:
            out = out + probs[..., T - S :] @ fresh_v.astype(mx.float32)
        return out.reshape(B, n_q, L, Dv).astype(queries.dtype)

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] as attention sees them (keys with the QJL term's expectation:
        its dequantization sqrt(pi/2)/D ||r|| S^T sign(S r))."""
        H, Dk, Dv = self.dims
        a = self._used()
        u = self.cb_k[unpack(a["k_codes"], self.code_bits, Dk)]
        if self.qjl:
            signs = unpack(a["k_signs"], 1, Dk).astype(mx.float32) * 2 - 1
            u = u + math.sqrt(math.pi / 2) / Dk * a["k_res_norms"].astype(mx.float32)[..., None] * (signs @ self.sketch[None])
        keys = (u @ self.rot_k[None]) * a["k_norms"].astype(mx.float32)[..., None]
        values = (self.cb_v[unpack(a["v_codes"], self.value_bits, Dv)] @ self.rot_v[None]) * a["v_norms"].astype(mx.float32)[..., None]
        return keys, values

    def make_mask(self, N, return_array=False, window_size=None):
        return mlx_cache.create_attention_mask(N, self.offset, return_array, window_size)

    @property
    def tokens_kept(self) -> int:
        return self.offset

    @property
    def live_kv_bytes(self) -> int:
        # the held rows of every stored array (the rows allocated ahead are not held tokens)
        return 0 if self.arrays is None else array_bytes(*self._used().values())

    def empty(self):
        return self.arrays is None

    # mlx-lm 0.32's loader rebuilds a cache from `state` alone (`from_state`): the arrays, then one
    # string with the bit widths, the seed and the dims (the rotations and the sketch are redrawn)
    @property
    def state(self):
        a = self._used()
        H, Dk, Dv = self.dims
        return [*(a[name] for name in sorted(a)), f"{self.key_bits},{self.value_bits},{self.seed},{int(self.qjl)},{H},{Dk},{Dv}"]

    @state.setter
    def state(self, v):
        *arrays, meta = v
        self.key_bits, self.value_bits, self.seed, qjl, H, Dk, Dv = map(int, meta.split(","))
        self.qjl = bool(qjl)
        self._setup(H, Dk, Dv)
        names = ("k_codes", "k_norms", "v_codes", "v_norms") + (("k_res_norms", "k_signs") if self.qjl else ())
        self.arrays = dict(zip(sorted(names), arrays))
        self.offset = self.arrays["k_norms"].shape[2]
        self._fresh = None


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "TurboQuantCache", TurboQuantCache)
