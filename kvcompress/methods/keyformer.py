"""Keyformer (Adnan et al., MLSys 2024, arXiv:2403.09054) and H2O as its tau = 0 ablation.

Keyformer keeps `budget` = k tokens per KV head: a recent window of w tokens plus the k - w "key
tokens" with the highest accumulated score (Sec. 3.3). The score of key j after query step t is

    s_j += softmax_j((x_tj + zeta_tj) / tau_t)                       (paper Eq. 6-8)

where x_tj are the real attention logits of query t (post-RoPE, scaled), zeta ~ Gumbel(0, 1) and
tau_t = tau_init + t * (tau_end - tau_init) / T anneals linearly over the T generated tokens
(Eq. 10; the prompt is scored at tau_init). With GQA a KV head's score is the sum over its query
group. tau = 0 is taken to mean "no regularization": s_j += softmax(x_tj), which is H2O (Zhang et
al., NeurIPS 2023).

Implementation choices (each tested):
- Batched: the state is keys/values [B*H_kv, n_kept, D], scores and positions [B*H_kv, n_kept];
  every step is one MLX computation over all rows.
- Real queries: the patched attention (kvcompress/attention.py) calls `attention()` with the
  post-RoPE queries; it computes attention explicitly and accumulates the scores from the same
  logits. `score="proxy"` instead reproduces the reference system: the incoming key acts as the
  query, the accumulated score is noise-free and Gumbel noise is added (times tau) only when
  choosing what to evict.
- Noise is a counter-based hash of (seed, layer, row = b * H_kv + h, query position, key position),
  so it is deterministic, differs across layers and heads, and is the same however the prompt is
  chunked. `noise="redraw"` draws fresh noise for every query step (paper); `noise="frozen"` draws
  one value per key position (reference system). Noise is recomputed from positions, never stored.
  The query heads of one KV head share its noise: the noise regularizes that KV head's decision.
- Prefill keeps everything (full causal attention, chunked as mlx-lm chunks it), accumulates the
  prompt's scores, then makes one vectorized selection down to the budget. Each decode step then
  evicts at most one token per row (kvcompress/kernels/keyformer_evict.py).
- Positions: `positions="exact"` (default) keeps every key rotated at its true position and
  `offset` is the true sequence position. `positions="compact"` re-rotates survivors to the
  contiguous positions 0..n_kept-1 and reports `offset = n_kept` (StreamingLLM-style). RoPE
  rotations are read off the model's own RoPE module (its base, scaling and layout), never assumed.

Cost: prompt scoring is a second causal softmax over the prompt plus Gumbel noise per (query, key)
(~1 s per layer at 2k tokens on the 2-core CPU). A decode step appends (one copy of K and V) and
compacts (another): on the CPU that makes the batched step memory-bound for large B*H_kv*n_kept
(benchmarks/keyformer_update.py); on the H200 the fused eviction of 32 x 8192 x 128 fp16 rows takes
~0.26 ms (benchmarks/keyformer_gpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from ..attention import attention_geometry, install
from ..kernels.keyformer_evict import evict_one, protected_mask, rotate_pairs
from .base import CompressedCache, ConfigError, Method, array_bytes, budget_tokens, check, check_budget

SCORES = ("attention", "proxy")
NOISES = ("redraw", "frozen")
POSITION_MODES = ("exact", "compact")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Keyformer(Method):
    """Keyformer: recent window + key tokens chosen by Gumbel-regularized accumulated attention.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float; paper 0.6).
    recent: recent window w, tokens (int) or a fraction of the budget (float; paper 0.3).
    n_sink: first tokens never evicted (paper: 0).
    tau_init, tau_end: Gumbel-softmax temperature, annealed linearly over `anneal_steps` generated
        tokens (paper: 1 -> 2 over max_new_tokens); equal values give a constant tau; both 0 is H2O.
    score: "attention" (real queries, paper) or "proxy" (incoming key as query, reference system).
    noise: "redraw" (fresh each step, paper) or "frozen" (one draw per key position).
    positions: "exact" (true RoPE positions) or "compact" (survivors re-rotated to 0..n_kept-1).
    seed: base seed of the noise.
    """

    name = "keyformer"
    needs_queries = True
    budget: int | float = 0.6
    recent: int | float = 0.3
    n_sink: int = 0
    tau_init: float = 1.0
    tau_end: float = 2.0
    anneal_steps: int = 128
    score: str = "attention"
    noise: str = "redraw"
    positions: str = "exact"
    seed: int = 0

    def __post_init__(self):
        n = self.name
        check_budget(f"{n}.budget", self.budget)
        check(
            (_is_int(self.recent) and self.recent >= 0) or (isinstance(self.recent, float) and 0.0 <= self.recent < 1.0),
            f"{n}.recent", "a token count >= 0 or a budget fraction in [0, 1)", self.recent,
        )
        check(_is_int(self.n_sink) and self.n_sink >= 0, f"{n}.n_sink", "an int >= 0", self.n_sink)
        for field in ("tau_init", "tau_end"):
            value = getattr(self, field)
            finite = _is_real(value) and value == value and value != float("inf")
            check(finite and value >= 0, f"{n}.{field}", "a finite number >= 0", value)
        check(
            (self.tau_init == 0) == (self.tau_end == 0),
            f"{n}.tau_end", f"0 together with tau_init=0 (H2O) or > 0 together with tau_init > 0 (tau_init={self.tau_init})",
            self.tau_end,
        )
        check(
            _is_int(self.anneal_steps) and self.anneal_steps >= 1,
            f"{n}.anneal_steps", "an int >= 1 (generated tokens)", self.anneal_steps,
        )
        check(self.score in SCORES, f"{n}.score", f"one of {SCORES}", self.score)
        check(self.noise in NOISES, f"{n}.noise", f"one of {NOISES}", self.noise)
        check(self.positions in POSITION_MODES, f"{n}.positions", f"one of {POSITION_MODES}", self.positions)
        check(_is_int(self.seed) and 0 <= self.seed < 2**32, f"{n}.seed", "an int in [0, 2**32)", self.seed)
        if _is_int(self.budget):
            self.resolve(self.budget)

    def resolve(self, prompt_tokens: int) -> tuple[int, int]:
        """(capacity, recent window) in tokens for a prompt; ConfigError when no key-token slot is left."""
        capacity = budget_tokens(self.budget, prompt_tokens)
        recent = round(self.recent * capacity) if isinstance(self.recent, float) else self.recent
        if capacity <= self.n_sink + recent:
            raise ConfigError(
                f"{self.name}.budget: expected more tokens than n_sink + recent = {self.n_sink} + {recent} "
                f"(room for at least one key token), got {self.budget!r} = {capacity} tokens"
                + (f" of a {prompt_tokens}-token prompt" if isinstance(self.budget, float) else "")
            )
        return capacity, recent

    def tau(self, decode_step: mx.array) -> mx.array:
        """Eq. 10: tau_init + t * (tau_end - tau_init) / T, t clipped to [0, T] (the prompt is t < 0)."""
        t = mx.clip(decode_step.astype(mx.float32), 0, self.anneal_steps)
        return self.tau_init + t * ((self.tau_end - self.tau_init) / self.anneal_steps)

    def make_cache(self, model) -> list:
        install()  # the caches score inside attention(); without the hook nothing would be evicted
        geometry = attention_geometry(model)
        scale = getattr(model.layers[0].self_attn, "scale", geometry.head_dim**-0.5)
        return [
            KeyformerCache(self, layer, geometry.n_kv_heads, geometry.head_dim, model.layers[layer].self_attn.rope, scale)
            for layer in range(geometry.n_layers)
        ]


@dataclass(frozen=True)
class H2O(Keyformer):
    """H2O (Zhang et al., NeurIPS 2023): Keyformer's tau = 0 ablation, plain accumulated attention."""

    name = "h2o"
    tau_init: float = 0.0
    tau_end: float = 0.0

    def __post_init__(self):
        check(self.tau_init == 0, f"{self.name}.tau_init", "0 (H2O is Keyformer without noise)", self.tau_init)
        check(self.tau_end == 0, f"{self.name}.tau_end", "0 (H2O is Keyformer without noise)", self.tau_end)
        super().__post_init__()


# ---------------------------------------------------------------------------------------------
# Noise: a counter-based hash, so a value depends only on its coordinates (not on call order).


def _mix(x: mx.array) -> mx.array:
    # "lowbias32" integer finalizer (C. Wellons): full avalanche on uint32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def gumbel_noise(
    seed: int, layer: int, rows: mx.array, query_positions: mx.array | None, key_positions: mx.array
) -> mx.array:
    """Gumbel(0, 1) noise [R, L, n] (or [R, 1, n] when query_positions is None: frozen noise).

    rows [R] (b * H_kv + h), query_positions [L] true positions of the query steps, key_positions
    [R, n] true positions of the keys. zeta = -log(-log(u)), u uniform in (0, 1) from 24 hash bits.
    """
    u32 = mx.uint32
    stream = _mix(_mix(_mix(mx.array(seed, u32)) ^ mx.array(layer, u32)) ^ rows.astype(u32))  # [R]
    if query_positions is None:
        step = _mix(stream)[:, None]  # [R, 1]
    else:
        step = _mix(stream[:, None] ^ (query_positions.astype(u32) + 1)[None])  # [R, L]
    h = _mix(step[:, :, None] ^ key_positions.astype(u32)[:, None, :])
    u = ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))
    return -mx.log(-mx.log(u))


def rope_rotations(rope, head_dim: int, count: int) -> tuple[mx.array, mx.array]:
    """cos, sin [count, dims/2] of the model's own RoPE at positions 0..count-1.

    Read off the module by rotating a probe vector (1 in the first element of every pair), so the
    base, any frequency scaling and the pair layout are the model's, not assumptions.
    """
    dims = getattr(rope, "dims", head_dim)
    traditional = getattr(rope, "traditional", False)
    probe = mx.zeros((1, 1, count, head_dim), mx.float32)
    first = mx.arange(head_dim)
    first = ((first % 2 == 0) & (first < dims)) if traditional else (first < dims // 2)
    probe = probe + first.astype(mx.float32)
    out = rope(probe)[0, 0]
    if traditional:
        return out[:, 0:dims:2], out[:, 1:dims:2]
    return out[:, : dims // 2], out[:, dims // 2 : dims]


def _causal(L: int, n: int) -> mx.array:
    """[L, n] True where query i (the i-th of the last L slots) may attend to slot j."""
    return mx.arange(n)[None] <= (n - L + mx.arange(L))[:, None]


class KeyformerCache(CompressedCache):
    """One layer's Keyformer cache (mlx-lm cache protocol plus `attention` and `from_prefill`).

    Rows are (batch, KV head) pairs, tokens are kept in temporal order. `positions` holds each kept
    token's true sequence position (used by the noise hash and the exact-mode claim); in compact
    mode a token is rotated at its slot index instead.
    """

    def __init__(self, config: Keyformer, layer: int, n_kv_heads: int, head_dim: int, rope, scale: float):
        self.config, self.layer = config, layer
        self.n_kv_heads, self.head_dim, self.rope, self.scale = n_kv_heads, head_dim, rope, scale
        self.traditional = getattr(rope, "traditional", False)
        self.keys = self.values = None  # [R, n_kept, D]
        self.scores = None  # [R, n_kept] float32 accumulated score
        self.positions = None  # [R, n_kept] int32 true positions
        self.batch = 0
        self.position = 0  # true position of the next token
        self.offset = 0  # what mlx-lm rotates the next token at: position (exact) or n_kept (compact)
        self.prompt_len = None  # known once the prompt is complete
        self.capacity = self.recent = None
        self._unscored = 0  # tokens appended by update_and_fetch and not yet seen by attention()
        self._one_step = None  # (cos, sin) of one RoPE position, for compact-mode eviction

    # -- mlx-lm protocol ------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys, values: [B, H_kv, S, D] post-RoPE
        if self._unscored:
            raise RuntimeError("KeyformerCache needs kvcompress's attention hook: call kvcompress.attention.install()")
        B, H, S, D = keys.shape
        self.batch = B
        new_positions = mx.broadcast_to(mx.arange(self.position, self.position + S, dtype=mx.int32), (B * H, S))
        R = B * H
        self._append(keys.reshape(R, S, D), values.reshape(R, S, D), mx.zeros((R, S), mx.float32), new_positions)
        self.position += S
        self._unscored = S
        self.offset = self.position if self.config.positions == "exact" else self.tokens_kept
        n = self.tokens_kept
        return self.keys.reshape(B, H, n, D), self.values.reshape(B, H, n, D)

    def attention(self, queries, keys, values, scale, mask):
        """Attention of the S new queries over the kept tokens, plus the score update and eviction."""
        # queries: [B, H_q, S, D]; keys/values: the [B, H_kv, n, D] update_and_fetch returned
        B, n_q, S, D = queries.shape
        n = self.tokens_kept
        if isinstance(mask, str):
            mask = _causal(S, n)
        logits = self._logits(queries, self.keys, scale)  # [R, rep, S, n]
        if mask is not None:
            logits = mx.where(mask, logits, -mx.inf) if mask.dtype == mx.bool_ else logits + mask
        probs = mx.softmax(logits, axis=-1, precise=True)
        out = probs.reshape(B * self.n_kv_heads, -1, n) @ self.values.astype(mx.float32)
        query_positions = mx.arange(self.position - S, self.position, dtype=mx.int32)
        self.scores = self.scores + self._increments(logits, probs, self.keys, query_positions, scale)
        self._unscored = 0
        self._after_step(S)
        return out.reshape(B, n_q, S, D).astype(queries.dtype)

    def make_mask(self, N, return_array=False, window_size=None):
        # stored keys are [kept..., N new] in temporal order: causal relative to the kept count
        return create_attention_mask(N, self.tokens_kept, return_array, window_size)

    @property
    def state(self):
        return self.keys, self.values, self.scores, self.positions

    @state.setter
    def state(self, v):
        self.keys, self.values, self.scores, self.positions = v

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return False

    def trim(self, n):
        return 0

    def kept_positions(self):
        return self.positions

    def held_kv(self):
        R, n, D = self.keys.shape
        return self.keys.reshape(self.batch, R // self.batch, n, D), self.values.reshape(self.batch, R // self.batch, n, D)

    @property
    def tokens_kept(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    @property
    def live_kv_bytes(self) -> int:
        """Resident bytes: keys and values plus the per-token scores and positions (also resident)."""
        return array_bytes(self.keys, self.values, self.scores, self.positions)

    # -- runner entry ---------------------------------------------------------------------------

    def from_prefill(self, keys, values, queries=None):
        """Compress a finished full-attention prefill: score the prompt, then one selection.

        keys, values [B, H_kv, T, D] post-RoPE at positions 0..T-1; queries [B, H_q, T, D] post-RoPE
        (required for score="attention").
        """
        B, H, T, D = keys.shape
        cfg = self.config
        self.capacity, self.recent = cfg.resolve(T)  # reject before any work
        if cfg.score == "attention" and queries is None:
            raise ValueError("keyformer with score='attention' needs the prompt's queries")
        self.batch = B
        R = B * H
        self.keys, self.values = keys.reshape(R, T, D), values.reshape(R, T, D)
        self.positions = mx.broadcast_to(mx.arange(T, dtype=mx.int32), (R, T))
        self.position = self.offset = T
        scores = mx.zeros((R, T), mx.float32)
        # bound the [R, rep, rows, T] logits to ~2^24 elements per chunk
        rep = 1 if queries is None else queries.shape[1] // H
        rows = max(1, (1 << 24) // (R * rep * T))
        for start in range(0, T, rows):
            stop = min(T, start + rows)
            keys_seen = self.keys[:, :stop]
            q = None if queries is None else queries[:, :, start:stop]
            logits = None
            if cfg.score == "attention":
                logits = mx.where(_causal(stop - start, stop), self._logits(q, keys_seen, self.scale), -mx.inf)
            # plain attention probabilities are needed only for H2O's score (no output here)
            probs = mx.softmax(logits, axis=-1, precise=True) if cfg.score == "attention" and cfg.tau_init == 0 else None
            inc = self._increments(logits, probs, keys_seen, mx.arange(start, stop, dtype=mx.int32), self.scale)
            scores = scores + mx.pad(inc, ((0, 0), (0, T - stop)))
            mx.eval(scores)
        self.scores = scores
        self.prompt_len = T
        if T > self.capacity:
            self._select(self.capacity, T - 1)

    # -- internals ------------------------------------------------------------------------------

    def _append(self, keys, values, scores, positions):
        if self.keys is None:
            self.keys, self.values, self.scores, self.positions = keys, values, scores, positions
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=1)
            self.values = mx.concatenate([self.values, values], axis=1)
            self.scores = mx.concatenate([self.scores, scores], axis=1)
            self.positions = mx.concatenate([self.positions, positions], axis=1)

    def _logits(self, queries, keys, scale):
        # queries [B, H_q, L, D], keys [R, n, D] -> [R, rep, L, n]; each KV head's query group is
        # folded into the row axis (exact on CPU and CUDA; broadcast batch dims are not on CUDA)
        B, n_q, L, D = queries.shape
        R, n, _ = keys.shape
        rep = n_q // (R // B)
        q = queries.astype(mx.float32).reshape(R, rep * L, D) * scale
        # keys @ q^T transposes only the small query block, never the [n, D] keys
        logits = keys.astype(mx.float32) @ q.swapaxes(1, 2)  # [R, n, rep * L]
        return logits.swapaxes(1, 2).reshape(R, rep, L, n)

    def _rows(self, R):
        return mx.arange(R, dtype=mx.uint32)

    def _increments(self, logits, probs, keys, query_positions, scale):
        """Score added to every key by the queries at query_positions [L] -> [R, n]."""
        cfg = self.config
        R, n, _ = keys.shape
        L = query_positions.shape[0]
        if cfg.score == "proxy":
            # reference system: the incoming key stands in for the query, no noise in the score
            k = keys.astype(mx.float32)
            proxy = (k[:, n - L :] * scale) @ k.swapaxes(1, 2)  # [R, L, n]
            proxy = mx.where(_causal(L, n), proxy, -mx.inf)
            return mx.softmax(proxy, axis=-1, precise=True).sum(axis=1)
        if cfg.tau_init == 0:  # H2O
            return probs.sum(axis=(1, 2))
        steps = None if cfg.noise == "frozen" else query_positions
        noise = gumbel_noise(cfg.seed, self.layer, self._rows(R), steps, self.positions[:, :n])  # [R, L|1, n]
        tau = cfg.tau(query_positions - self._prompt_end())[:, None]  # [L, 1]
        noisy = mx.softmax((logits + noise[:, None]) / tau, axis=-1, precise=True)
        return noisy.sum(axis=(1, 2))

    def _prompt_end(self) -> int:
        # before the prompt is complete every query is a prompt query (tau_init)
        return self.prompt_len if self.prompt_len is not None else 1 << 30

    def _after_step(self, S):
        """Prefill keeps everything; the first single-token call completes the prompt.

        mlx-lm's generate_step feeds the prompt in chunks and its last token alone, so that call is
        the prompt's last query: the runner's from_prefill selects after the same T tokens.
        """
        if self.prompt_len is None:
            if S > 1:
                return
            self.prompt_len = self.position
            self.capacity, self.recent = self.config.resolve(self.prompt_len)
        n = self.tokens_kept
        if n <= self.capacity:
            return
        step = self.position - 1  # the query position of this step
        if n == self.capacity + 1:
            self._evict_one(step)
        else:
            self._select(self.capacity, step)

    def _evict_by(self, step: int) -> mx.array:
        cfg = self.config
        if cfg.score != "proxy" or cfg.tau_init == 0:
            return self.scores
        # reference system: noise (times the current tau) enters only the eviction decision
        steps = None if cfg.noise == "frozen" else mx.array([step], mx.int32)
        noise = gumbel_noise(cfg.seed, self.layer, self._rows(self.keys.shape[0]), steps, self.positions)[:, 0]
        tau = cfg.tau(mx.array(step - self._prompt_end()))
        return self.scores + tau * noise

    def _evict_one(self, step: int):
        rotation = None
        if self.config.positions == "compact":
            if self._one_step is None:
                cos, sin = rope_rotations(self.rope, self.head_dim, 2)
                self._one_step = (cos[1], sin[1])
            rotation = self._one_step
        self.keys, self.values, self.scores, self.positions, _ = evict_one(
            self.keys, self.values, self.scores, self.positions, self._evict_by(step),
            self.config.n_sink, self.recent, rotation, self.traditional,
        )
        self.offset = self.position if self.config.positions == "exact" else self.tokens_kept

    def _select(self, capacity: int, step: int):
        """Keep the protected slots and the top-scoring rest, `capacity` per row, in temporal order."""
        n = self.tokens_kept
        protected = protected_mask(n, self.config.n_sink, self.recent)[None]
        ranked = mx.where(protected, mx.inf, self._evict_by(step))
        keep = mx.sort(mx.argpartition(-ranked, kth=capacity - 1, axis=1)[:, :capacity], axis=1)  # [R, capacity]
        keys = mx.take_along_axis(self.keys, keep[..., None], axis=1)
        if self.config.positions == "compact":
            # slot keep[i] was rotated at position keep[i] (contiguous so far); move it to i
            cos, sin = rope_rotations(self.rope, self.head_dim, n)
            back = keep - mx.arange(capacity)[None]  # [R, capacity] >= 0 positions to go back
            keys = rotate_pairs(keys, cos[back], -sin[back], self.traditional)
        self.keys = keys
        self.values = mx.take_along_axis(self.values, keep[..., None], axis=1)
        self.scores = mx.take_along_axis(self.scores, keep, axis=1)
        self.positions = mx.take_along_axis(self.positions, keep, axis=1)
        self.offset = self.position if self.config.positions == "exact" else self.tokens_kept
