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
each other exactly, as KIVI's full-precision residual does; their codes serve every later call.
That is a decode step's path; a prefill chunk (or a model with sinks) dequantizes the held tokens
once, in blocks, and runs MLX's fused attention (`prefill_attention`, docs/methods.md: its peak).

Fractional widths (2.5, 3.5 per side; the paper's Section 4.3 "outlier" split, built as mlx-vlm
builds it): the channels are split into an outlier set and the rest, and each set gets its own
independent TurboQuant (own norm, rotation, codebook and sketch over its own dimension), the
outliers at ceil(bits) and the rest at floor(bits). The outliers are the round(frac * D) channels
with the largest mean |x| over the layer's first call's tokens (the prompt; every head and token),
kept for the layer's life, so the mean width is exactly `bits` (2.5 on D = 64: 32 channels at 3
bits, 32 at 2). The paper's example for 2.5 bits splits 32 of 128 channels at 3 bits and 96 at 2:
2.25 bits of codes (2.5 if the two parts' float16 norms are counted, 0.25 a channel); we follow
mlx-vlm's count, where the codes alone average the named width. mlx-vlm's `bits=3.5` alone means keys 3, values 4 (no
split); here `bits=3.5` splits both sides, and key_bits / value_bits set each side.

The decode path above is the plain MLX reference: it gathers the codebook entries of the held codes
per call, a transient, not a stored copy. A decode call (at most 8 query rows a KV head, no sinks, an
integer width, head dim 32 / 64 / 128) on a GPU instead runs the fused kernel of
kvcompress/kernels/turboquant_attention.py over the codes (CUDA and Metal from one body, chosen and
self-tested through kernels/dispatch.py): the held tokens' softmax part there, the call's own tokens
exactly here, the two merged by their log-sum-exps. `live_kv_bytes` is the packed codes, signs and
norms held, a fractional width's channel indices, and the layer's rotations, sketches and codebooks
(drawn per layer from the seed and the layer's index: resident as long as the cache).

Draws: every matrix has its own key, (seed, layer, side, part, purpose): side 0 keys / 1 values, part
0 / 1 the low / outlier channels of a fractional width, purpose 0 the rotation / 1 the sketch; NumPy's
SeedSequence turns each key into an independent stream. (Until 2026-12-07 one integer per layer was
offset by small constants per purpose, so layer i+1's rotation was drawn from layer i's sketch seed,
and values' from the keys' of layer i+7.)

Departures: every token is stored quantized when it arrives (no full-precision window beyond the
current call). Norms are kept in float16.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np

from ...attention import install, masked_softmax
from ...errors import check
from ...kernels import turboquant_attention
from ..base import Method, array_bytes
from .base import CodesCache, PerSideBits, attention_over, dequantized_blocks, pack, unpack, write_rows

BITS = (2, 2.5, 3, 3.5, 4)


@dataclass(frozen=True)
class TurboQuant(PerSideBits, Method):
    """TurboQuant: rotated Lloyd-Max codes per coordinate; keys add a 1-bit QJL residual.

    bits: bits per coordinate for keys and values (2, 2.5, 3, 3.5, 4; a fractional width stores its
    outlier channels at one bit more); key_bits / value_bits override it per side. Keys spend one of their bits on the QJL sign sketch (the paper's TurboQuant_prod); with
    qjl=False they spend all on codes (TurboQuant_mse: lower error, biased inner products).
    seed: the rotations and the sketch.
    """

    name = "turboquant"
    stores_quantized = True  # an eviction method's `quantize` may name it (methods/composed.py)
    bits: float = 4
    key_bits: float | None = None
    value_bits: float | None = None
    qjl: bool = True
    seed: int = 0
    # 1: independent per-layer, per-purpose draws (module docstring), 2026-12-07
    revision = 1

    def __post_init__(self):
        self.check_bits(BITS)
        check(isinstance(self.seed, int), "turboquant.seed", "an int", self.seed)
        check(isinstance(self.qjl, bool), "turboquant.qjl", "true or false", self.qjl)

    def make_cache(self, model) -> list:
        install()  # the caches attend over their codes themselves
        return super().make_cache(model)

    def layer_cache(self, layer, i, n, layout):
        return self.new_cache(i)

    def new_cache(self, i: int) -> "TurboQuantCache":
        """An empty cache for the i-th compressed layer (its own draws: the seed and i)."""
        return TurboQuantCache(self.k_bits, self.v_bits, self.seed, self.qjl, layer=i)


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


ROTATION, SKETCH = 0, 1  # the last element of a matrix's draw key (module docstring)


def draw(key: tuple[int, ...]) -> np.random.Generator:
    """An independent stream for one matrix: SeedSequence over the whole key (any int seed, taken
    modulo 2^64, as SeedSequence takes non-negative entropy)."""
    return np.random.default_rng([k % (1 << 64) for k in key])


def random_rotation(heads: int, dim: int, key: tuple[int, ...]) -> mx.array:
    """[heads, dim, dim] random orthogonal matrices: QR of seeded Gaussians, signs fixed (Haar)."""
    rng = draw((*key, ROTATION))
    out = np.empty((heads, dim, dim), np.float32)
    for h in range(heads):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        out[h] = q * np.sign(np.diag(r))[None]
    return mx.array(out)


def sketch_matrix(heads: int, dim: int, key: tuple[int, ...]) -> mx.array:
    """[heads, dim, dim] the QJL transform S: i.i.d. standard Gaussians, seeded."""
    return mx.array(draw((*key, SKETCH)).standard_normal((heads, dim, dim)).astype(np.float32))


def nearest(u: mx.array, centroids: mx.array) -> mx.array:
    """Index of the nearest centroid (ascending) for each coordinate of u: the number of cell edges
    (midpoints, float32) below it, counted one edge at a time in uint8 (not a [..., 2^b - 1] array of
    comparisons as wide as u's floats x 2^b / 4)."""
    c = np.array(centroids, np.float32)
    code = mx.zeros(u.shape, mx.uint8)
    for edge in (c[1:] + c[:-1]) / 2:
        code = code + (u > float(edge))
    return code.astype(mx.uint32)


class Codec:
    """One TurboQuant instance: the codes of `dim`-dim vectors (a side, or one channel subset of it,
    for the fractional widths) at `bits` bits a coordinate, per KV head.

    Stored per token (names of the arrays `quantize` returns): "codes" [.., dim*b/32] uint32 (b =
    bits - 1 with the QJL residual, else bits), "norms" f16; with the QJL residual "signs"
    [.., dim/32] uint32 and "res_norms" f16 (32-bit words padded where dim*b is not a multiple of 32)."""

    def __init__(self, heads: int, dim: int, bits: int, key: tuple[int, ...], qjl: bool):
        # key: (seed, layer, side, part), the matrices' draws (module docstring)
        self.dim, self.bits, self.qjl = dim, bits, qjl
        self.rotation = random_rotation(heads, dim, key)  # [H, dim, dim]
        self.sketch = sketch_matrix(heads, dim, key) if qjl else None  # [H, dim, dim]
        self.code_bits = bits - 1 if qjl else bits
        centroids = codebook(dim, self.code_bits).astype(np.float32)
        self.codebook = mx.array(centroids)
        self.centroids = tuple(float(x) for x in centroids)  # for the fused kernel's constants

    def quantize(self, x: mx.array) -> dict[str, mx.array]:
        """x [B, H, S, dim] -> the stored arrays of S tokens."""
        x = x.astype(mx.float32)
        norm = mx.sqrt((x * x).sum(-1, keepdims=True))
        u = (x / mx.maximum(norm, 1e-30)) @ self.rotation.swapaxes(-1, -2)[None]  # Pi x / ||x||  [B, H, S, dim]
        codes = nearest(u, self.codebook)
        stored = {"codes": pack(codes, self.code_bits), "norms": norm[..., 0].astype(mx.float16)}
        if self.qjl:
            r = u - self.codebook[codes]
            signs = ((r @ self.sketch.swapaxes(-1, -2)[None]) >= 0).astype(mx.uint32)  # sign(S r) as bits
            stored.update(signs=pack(signs, 1), res_norms=mx.sqrt((r * r).sum(-1)).astype(mx.float16))
        return stored

    def names(self) -> tuple[str, ...]:
        return ("codes", "norms") + (("res_norms", "signs") if self.qjl else ())

    def scores(self, q: mx.array, a: dict[str, mx.array]) -> mx.array:
        """<q, x> for queries q [B, H, M, dim] and the T tokens held in `a`: [B, H, M, T]."""
        q_rot = q @ self.rotation.swapaxes(-1, -2)[None]  # Pi q
        scores = q_rot @ self.codebook[unpack(a["codes"], self.code_bits, self.dim)].swapaxes(-1, -2)
        if self.qjl:
            q_sketch = q_rot @ self.sketch.swapaxes(-1, -2)[None]  # S Pi q
            signs = unpack(a["signs"], 1, self.dim).astype(mx.float32) * 2 - 1  # [B, H, T, dim]
            qjl = math.sqrt(math.pi / 2) / self.dim * a["res_norms"].astype(mx.float32)[:, :, None]  # [B, H, 1, T]
            scores = scores + qjl * (q_sketch @ signs.swapaxes(-1, -2))
        return scores * a["norms"].astype(mx.float32)[:, :, None]

    def weighted_sum(self, weights: mx.array, a: dict[str, mx.array]) -> mx.array:
        """sum_t weights[.., t] x_t for weights [B, H, M, T]: [B, H, M, dim], summed in the rotated
        space and rotated back once."""
        unit = self.codebook[unpack(a["codes"], self.code_bits, self.dim)]  # [B, H, T, dim] rotated unit vectors
        return ((weights * a["norms"].astype(mx.float32)[:, :, None]) @ unit) @ self.rotation[None]

    def dequantize(self, a: dict[str, mx.array]) -> mx.array:
        """[B, H, T, dim] as `scores` sees them (with the QJL term's dequantization
        sqrt(pi/2)/dim ||r|| S^T sign(S r), whose expectation is the residual)."""
        u = self.codebook[unpack(a["codes"], self.code_bits, self.dim)]
        if self.qjl:
            signs = unpack(a["signs"], 1, self.dim).astype(mx.float32) * 2 - 1
            u = u + math.sqrt(math.pi / 2) / self.dim * a["res_norms"].astype(mx.float32)[..., None] * (signs @ self.sketch[None])
        return (u @ self.rotation[None]) * a["norms"].astype(mx.float32)[..., None]


def outlier_channels(x: mx.array, bits: float) -> mx.array:
    """The channels a fractional width stores at one bit more: the round((bits - floor(bits)) * D)
    channels of x [B, H, S, D] with the largest mean |x| over every token and head (as mlx-vlm), in
    ascending order, int32."""
    D = x.shape[-1]
    n_high = min(D - 1, max(1, round((bits - math.floor(bits)) * D)))
    magnitude = np.asarray(mx.abs(x.astype(mx.float32)).mean(axis=(0, 1, 2)))
    return mx.array(np.sort(np.argsort(magnitude, kind="stable")[-n_high:]).astype(np.int32))


class Side:
    """The keys or the values of a layer: one Codec over every channel (an integer width), or, for a
    fractional width, two independent Codecs (own rotation, norm, codebook and sketch): the outlier
    channels at ceil(bits), the rest at floor(bits). Array names carry the part's prefix."""

    def __init__(self, prefix: str, heads: int, dim: int, bits: float, key: tuple[int, ...], qjl: bool,
                 high: mx.array | None = None):
        # key: (seed, layer, side); each part adds its index (module docstring)
        self.high = high  # outlier channel indices [n_high] int32, or None for an integer width
        if high is None:
            self.parts = [(prefix, None, Codec(heads, dim, int(bits), (*key, 0), qjl))]
            return
        low = mx.array(np.setdiff1d(np.arange(dim), np.asarray(high)).astype(np.int32))
        self.parts = [(prefix, low, Codec(heads, low.size, math.floor(bits), (*key, 0), qjl)),
                      (prefix + "h", high, Codec(heads, high.size, math.ceil(bits), (*key, 1), qjl))]
        self.restore = mx.array(np.argsort(np.concatenate([np.asarray(low), np.asarray(high)])).astype(np.int32))

    def names(self) -> list[str]:
        return [f"{prefix}_{name}" for prefix, _, codec in self.parts for name in codec.names()]

    def _each(self, x: mx.array | None, arrays: dict[str, mx.array], rows: int, start: int = 0):
        for prefix, channels, codec in self.parts:
            own = None if x is None else (x if channels is None else mx.take(x, channels, axis=-1))
            yield own, {name: arrays[f"{prefix}_{name}"][:, :, start:rows] for name in codec.names()}, codec

    def quantize(self, x: mx.array) -> dict[str, mx.array]:
        """x [B, H, S, D] -> every part's stored arrays, by name."""
        out = {}
        for prefix, channels, codec in self.parts:
            own = x if channels is None else mx.take(x, channels, axis=-1)
            out.update({f"{prefix}_{name}": a for name, a in codec.quantize(own).items()})
        return out

    def scores(self, q: mx.array, arrays: dict[str, mx.array], rows: int) -> mx.array:
        """q [B, H, M, D] against the first `rows` tokens: [B, H, M, rows] (the parts' inner products add)."""
        return sum(codec.scores(own, a) for own, a, codec in self._each(q, arrays, rows))

    def _merge(self, pieces: list[mx.array]) -> mx.array:
        # the parts' channels back in the model's order
        return pieces[0] if self.high is None else mx.take(mx.concatenate(pieces, axis=-1), self.restore, axis=-1)

    def weighted_sum(self, weights: mx.array, arrays: dict[str, mx.array], rows: int) -> mx.array:
        return self._merge([codec.weighted_sum(weights, a) for _, a, codec in self._each(None, arrays, rows)])

    def dequantize(self, arrays: dict[str, mx.array], rows: int, start: int = 0) -> mx.array:
        """Tokens start..rows as `scores` / `weighted_sum` see them: [B, H, rows - start, D] float32."""
        return self._merge([codec.dequantize(a) for _, a, codec in self._each(None, arrays, rows, start)])

    def coded(self, arrays: dict[str, mx.array]) -> turboquant_attention.Coded | None:
        """The fused decode kernel's view of an integer width (its codec and whole buffers); None for a
        fractional width, whose two codecs the kernel does not take."""
        if self.high is not None:
            return None
        prefix, _, codec = self.parts[0]
        return turboquant_attention.Coded(codec, {name: arrays[f"{prefix}_{name}"] for name in codec.names()})


def fractional(bits: float) -> bool:
    return bits != math.floor(bits)


class TurboQuantCache(CodesCache):
    """One layer's TurboQuant storage (see the module docstring); tokens in order, all quantized.

    Per part (Codec.quantize): keys "k_codes" [B, H, cap, D*(kb-1)/32] uint32, "k_norms" [B, H, cap]
    f16, "k_signs" [B, H, cap, D/32] uint32, "k_res_norms" [B, H, cap] f16; values "v_codes"
    [B, H, cap, D*vb/32], "v_norms"; a fractional width's outlier part the same under "kh_" / "vh_"
    (and its channels, chosen from the first call's tokens). The first `offset` rows are in use.
    """

    def __init__(self, key_bits: float = 4, value_bits: float = 4, seed: int = 0, qjl: bool = True, layer: int = 0):
        # seed: the config's; layer: the compressed layer's index (together: this layer's draws)
        self.key_bits, self.value_bits, self.seed, self.qjl, self.layer = key_bits, value_bits, seed, qjl, layer
        self.arrays = None  # dict name -> buffer
        self.offset = 0
        self.dims = None  # (H, D_k, D_v)
        self._fresh = None  # (keys, values) of the tokens of the current call, until its attention

    def _setup(self, H: int, Dk: int, Dv: int, k_high: mx.array | None, v_high: mx.array | None):
        self.dims = (H, Dk, Dv)
        self.dtype = mx.float16  # what attention returns when the first keys' dtype is not known (a load)
        self.key_side = Side("k", H, Dk, self.key_bits, (self.seed, self.layer, 0), self.qjl, k_high)
        self.value_side = Side("v", H, Dv, self.value_bits, (self.seed, self.layer, 1), False, v_high)

    # -- mlx-lm protocol ------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys [B, H, S, Dk], values [B, H, S, Dv] post-RoPE
        if self.dims is None:  # a fractional width picks its outlier channels from the first tokens
            self._setup(keys.shape[1], keys.shape[3], values.shape[3],
                        outlier_channels(keys, self.key_bits) if fractional(self.key_bits) else None,
                        outlier_channels(values, self.value_bits) if fractional(self.value_bits) else None)
        # update_and_fetch hands the model this cache as its keys and values; a model that reads
        # their dtype (Phi-2 casts its attention output to it) gets the activations'
        self.dtype = values.dtype
        new = {**self.key_side.quantize(keys), **self.value_side.quantize(values)}
        self._fresh = (keys, values)  # this call's own tokens, which its queries see exactly
        self.arrays = write_rows(self.arrays, new, self.offset)
        self.offset += keys.shape[2]
        return self, self  # attention reads the codes from the cache itself

    def _used(self) -> dict[str, mx.array]:
        return {name: a[:, :, : self.offset] for name, a in self.arrays.items()}

    def prefill_attention(self, queries, fresh_k, fresh_v, scale, mask, sinks=None):
        """A prefill chunk's attention: the tokens held before the call dequantized once (keys with
        the QJL term, so <q, k> is the codes path's score), then the call's own exactly, through MLX's
        fused attention (base.attention_over). The codes path's [B, H, G*L, T] float32 scores would be
        GiBs a layer at a 2048-token chunk over a 32k context, far above the full cache."""
        fresh_k, fresh_v = ([], []) if fresh_k is None else ([fresh_k], [fresh_v])
        held = self.offset - sum(k.shape[2] for k in fresh_k)
        keys, values = (dequantized_blocks(lambda a, b, side=side: side.dequantize(self.arrays, b, a), 0, held,
                                           queries.dtype) for side in (self.key_side, self.value_side))
        return attention_over(queries, keys + fresh_k, values + fresh_v, scale, mask, sinks)

    def attention_on_codes(self, queries, fresh_k, fresh_v, scale, mask, sinks=None):
        """A decode step's attention on the codes: the query rotated (and sketched) once, scores from
        the codebook entries of the held codes, the call's own tokens exactly."""
        B, n_q, L, Dk = queries.shape
        H, _, Dv = self.dims
        G, T = n_q // H, self.offset
        S = 0 if fresh_k is None else fresh_k.shape[2]
        q = queries.astype(mx.float32).reshape(B, H, G * L, Dk)
        # a decode call (a GQA group's rows, no sinks, the held tokens all visible) may take the kernel
        every_held_visible = mask is None or (isinstance(mask, str) and mask == "causal" and S >= L)
        if G * L <= turboquant_attention.MAX_ROWS and sinks is None and every_held_visible:
            out = self._held_then_fresh(q, scale, T - S, L, mask is not None, fresh_k, fresh_v, queries.dtype)
            if out is not None:
                return out.reshape(B, n_q, L, Dv).astype(queries.dtype)
        scores = self.key_side.scores(q, self.arrays, T - S)  # [B, H, G*L, T - S]
        if S:
            scores = mx.concatenate([scores, q @ fresh_k.astype(mx.float32).swapaxes(-1, -2)], axis=-1)
        probs = masked_softmax((scores * scale).reshape(B, n_q, L, T), mask, sinks).reshape(B, H, G * L, T)
        out = self.value_side.weighted_sum(probs[..., : T - S], self.arrays, T - S)
        if S:
            out = out + probs[..., T - S :] @ fresh_v.astype(mx.float32)
        return out.reshape(B, n_q, L, Dv).astype(queries.dtype)

    def _held_then_fresh(self, q, scale, n, L, causal, fresh_k, fresh_v, dtype) -> mx.array | None:
        """Attention of q [B, H, M, Dk] through the fused kernel over the n held tokens' codes, merged
        with the call's fresh tokens exactly (kernels/turboquant_attention.py); None where the kernel
        does not take the call (or failed its self-test): the caller runs the reference."""
        keys, values = self.key_side.coded(self.arrays), self.value_side.coded(self.arrays)
        backend = turboquant_attention.decode_backend(q, keys, values, n, dtype, selftest_case)
        if backend is None:
            return None
        out, lse = turboquant_attention.attention_on_codes_fused(q, keys, values, n, scale, backend)
        if fresh_k is None:
            return out
        return turboquant_attention.with_fresh_tokens(out, lse, q, fresh_k, fresh_v, scale, L, causal)

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] as attention sees them (keys with the QJL term's expectation)."""
        return self.key_side.dequantize(self.arrays, self.offset), self.value_side.dequantize(self.arrays, self.offset)

    @property
    def quantized_tokens(self) -> int:
        return self.offset  # codes on arrival (the call's own tokens are seen exactly, then dropped)

    def _channels(self) -> list[mx.array]:
        return [side.high for side in (self.key_side, self.value_side) if side.high is not None]

    @property
    def live_kv_bytes(self) -> int:
        # the held rows of every stored array (the rows allocated ahead are not held tokens), the
        # outlier channels' indices of a fractional width, and the layer's own matrices
        return 0 if self.arrays is None else array_bytes(*self._used().values(), *self._channels(), *self._matrices())

    def _matrices(self) -> list[mx.array]:
        """This layer's rotations, sketches and codebooks (drawn per layer, held beside the codes: at
        D 128 and 8 KV heads 1.5 MiB a layer, as much as ~3k tokens of 4-bit codes)."""
        return [m for side in (self.key_side, self.value_side) for _, _, codec in side.parts
                for m in (codec.rotation, codec.sketch, codec.codebook) if m is not None]

    def empty(self):
        return self.arrays is None

    # mlx-lm 0.32's loader rebuilds a cache from `state` alone (`from_state`): the arrays, the outlier
    # channels of fractional widths (keys', then values'), then one string with the bit widths, the
    # seed, the layer and the dims (the rotations and the sketches are redrawn)
    @property
    def state(self):
        a = self._used()
        H, Dk, Dv = self.dims
        meta = f"{self.key_bits:g},{self.value_bits:g},{self.seed},{self.layer},{int(self.qjl)},{H},{Dk},{Dv}"
        return [*(a[name] for name in sorted(a)), *self._channels(), meta]

    @state.setter
    def state(self, v):
        *arrays, meta = v
        fields = meta.split(",")
        if len(fields) != 8:  # its codes were made with the draws of before revision 1: not decodable now
            raise ValueError("TurboQuantCache: this file was saved before 2026-12-07 (one seed per layer, "
                             "before independent per-layer draws); its codes need the old rotations: re-create it")
        kb, vb, seed, layer, qjl, H, Dk, Dv = fields
        self.key_bits, self.value_bits = (int(float(b)) if not fractional(float(b)) else float(b) for b in (kb, vb))
        self.seed, self.layer, self.qjl = int(seed), int(layer), bool(int(qjl))
        n_channels = fractional(self.key_bits) + fractional(self.value_bits)
        channels = iter(arrays[len(arrays) - n_channels:])
        self._setup(int(H), int(Dk), int(Dv), next(channels) if fractional(self.key_bits) else None,
                    next(channels) if fractional(self.value_bits) else None)
        names = sorted(self.key_side.names() + self.value_side.names())
        self.arrays = dict(zip(names, arrays[: len(names)]))
        self.offset = self.arrays["k_norms"].shape[2]
        self._fresh = None


def random_case(key_bits: int, value_bits: int, D: int, M: int, qjl: bool = True, seed: int = 0, T: int = 300,
                heads: int = 2):
    """A random decode problem on a real TurboQuantCache: (q [1, heads, M, D] float32, keys, values, n).

    Used by the kernel's self-test (`selftest_case`), the tests and the benchmarks. The cache holds T tokens (the default: two tiles
    and part of a third) written as a prompt and then a token at a time, so its buffers have spare rows."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    k = mx.random.normal((1, heads, T, D), key=k1)
    v = mx.random.normal((1, heads, T, D), key=k2)
    q = mx.random.normal((1, heads, M, D), key=k3)
    cache = TurboQuantCache(key_bits, value_bits, seed, qjl)
    prompt = max(1, T - 2)
    cache.update_and_fetch(k[:, :, :prompt], v[:, :, :prompt])
    for t in range(prompt, T):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    return q, cache.key_side.coded(cache.arrays), cache.value_side.coded(cache.arrays), T


def selftest_case(variant: tuple) -> tuple:
    """The decode kernel's self-test case for `variant` (key code bits, value bits, head dim, query rows,
    QJL): kernels/turboquant_attention.py takes it from here, as a kernel imports no method."""
    code_bits, value_bits, D, M, qjl = variant
    return random_case(code_bits + qjl, value_bits, D, M, qjl, seed=1)


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "TurboQuantCache", TurboQuantCache)
