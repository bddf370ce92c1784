"""Decode attention that also scores: the output, the logits and each key's attention, in one pass
over the keys and values. For the eviction methods whose scores are attention (H2O, TOVA, Keyformer).

A scoring eviction step needs, per KV row r (a (batch, KV head) pair) with G query heads and n kept
slots, the attention output and the probabilities softmax(q_g . k_j * scale) of every key. With MLX
ops that is SDPA for the output plus a second pass for the scores (logits matmul, softmax, a column
sum): the keys are read twice and ~8 kernels run per layer (docs/learned.md: 137 us
per layer at 16k slots on the H200 against SDPA's 41). Here:

1. `attend` (flash-decoding, Dao et al. 2023): the slots are cut into `nb` chunks, one thread block
   per (chunk, row). Each warp takes UN slots at a time (MAX_UNROLL, 4; fewer when 32 / G is) and
   issues all their key and value loads before using any. Lane l holds C = D / 32 consecutive
   channels of the G (pre-scaled) queries and reads them from each key and value row in one load
   (VEC_LOADS; else channels l, l + 32, ...): a warp's load is one coalesced row. The UN x G
   dot products meet in a reduce-scatter over the lanes (each halving step sends half the partial
   sums to the lane `m` away: 31 shuffles where a butterfly per sum took 160), after which lane l
   holds one whole dot product: it writes that logit, and the lanes of one head agree on its running
   max and sum (online softmax) with three more shuffles. The probabilities go through shared
   memory to every lane for the values. The block combines its warps in shared memory and writes a
   partial output and (max, sum) per head, and the kernel every slot's logits [R, G, n] (float32,
   natural units: q . k * scale).
2. `finish`: G warps of every block first combine the row's partial (max, sum) into the softmax's
   final max M_g and sum L_g; the first G * D threads of the row's grid also combine the partial
   outputs into the output; then each thread turns its slots' logits into probabilities
   exp(l - M_g) / L_g and writes their sum over the G heads, added to the given scores
   (ACCUMULATE: H2O's update in the same launch) or alone.

Keyformer (NOISY): its scores' softmax is of (logit + zeta) / tau, zeta the Gumbel noise of
kvcompress/kernels/counter_hash.py (a hash of the head's noise stream, the step's query position and
the key's true position, `GumbelNoise`). `attend` also keeps a running max and sum of those noisy
logits per head (the lane holding a logit draws its noise: one hash and two logs), `finish` combines
them and draws each slot's noise again (recomputed, not stored) for its probabilities, and adds
them to the scores; the MLX noise chain, softmax and sums of a Keyformer step go.

Choosing the slot to evict (EVICT): where the step's new scores are final after `finish` (H2O,
Keyformer scoring with queries), one `finish` block of 512 threads holds each row and also picks
the slot `evict_slot` (kernels/evict.py) would: the lowest unprotected score, ties to the lowest
position; one launch fewer per layer. It then sets that slot's score to 0, the score the cache's
next token (written there) starts from, so the token's write needs no score scatter: one more.

Every variant is checked against the plain reference, `scored_attention_reference` (MLX ops: the
logits' product, softmax, the output and the heads' column sum), on the H200
(tests/test_scored_attention.py) and on the CPU, where the CUDA source runs through
tests/cuda_on_cpu.py (g++, a thread per GPU thread, shuffles and barriers emulated;
tests/test_kernel_sources.py).

Two launches read the keys once, the values once and the [R, G, n] logits once (2 MiB at 16k
slots x 8 rows x 4 heads against 32 MiB of fp16 keys). Keys and values are the cache's buffers as
they are, [R, allocated, D] with the slots in use first: no slice, no copy. float32 accumulation;
exp via exp2 of (l - M) * log2(e). Not bit-identical to the MLX reference (other summation order):
within 1e-5 relative L2 for float32 (tests/test_scored_attention.py, on a GPU).

Speed on the H200 (8 rows x 4 heads, D 128, fp16, 16385 slots; docs/learned.md):
attend + finish 68-84 us per layer against cuDNN's SDPA alone 48-59 us, and against 128-153 us for
SDPA plus the MLX scoring ops it replaces (with the noise: 75-89; choosing the slot: 78-82). Nsight Compute: the attend kernel is latency-bound (12 warps per SM,
132 registers a thread; ~57% of issue cycles wait on global loads; DRAM at ~19% of peak). Tried
and measured slower: software-pipelined loads (the next slots' loads in flight during the current
ones: 91-104 against 82-92 us), more blocks per row (128 / 192: 92 / 124 us).

Supported: head_dim a multiple of 32 up to 256, 1..8 query heads per KV row, float16 / bfloat16 /
float32, one query per row (a decode step), no mask. `scored_attention` picks the path through
kernels/dispatch.py (self-test on first use, else the reference). The Metal body is the CUDA one
behind the macros of kivi_attention.py; never run on an Apple GPU, it is checked in the CPU
emulator (tests/test_metal_on_cpu.py); 8 heads at D 256 exceed a Metal threadgroup's 32 KiB and run
the reference there (`metal_fits`).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .counter_hash import gumbel_noise_from_streams, noise_streams
from . import dispatch
from .evict import evict_slot_reference
from .kivi_attention import CUDA_HEADER, METAL_HEADER

MAX_GROUP = 8
# `attend` reads a lane's C channels of a key or value row as one load (lane * C ... lane * C + C - 1)
# instead of C loads of channels lane, lane + 32, ...: a quarter of the load instructions at D 128
# fp16.
VEC_LOADS = True
# Slots a warp takes per step (at most; 32 / G when smaller): their loads are in flight together.
# Fewer hold fewer registers (132 a thread at 8, 12 warps per SM on the H200). With VEC_LOADS, 4
# took 68-77 us per layer where 8 took 83-85 and the plain loads at 8 84-100 (H200, 8 rows x 4
# heads, D 128, fp16, 16k slots; benchmarks/scored_attention_speed.py).
MAX_UNROLL = 4
THREADS = 128  # 4 warps per `attend` block
FINISH_THREADS = 256
# `finish` when it also picks the slot to evict: one block of these per row (1024 failed to launch
# with the noise at 8 heads on the H200: over 64 registers a thread)
EVICT_THREADS = 512
SLOTS_PER_FINISH_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# MLX reference


class GumbelNoise(NamedTuple):
    """Keyformer's score transform for the kernels: the scores' softmax is of (logits + zeta) / tau,
    zeta the Gumbel noise of kvcompress/kernels/counter_hash.py for each (query head, key position)."""

    streams: mx.array  # [R, G] uint32 noise streams of the query heads (counter_hash.noise_streams)
    positions: mx.array  # [R, >= n] int32 true positions of the slots (a buffer: the first n are read)
    query_position: int | None  # the step's query position (noise redrawn every step); None: frozen noise
    tau: float


class EvictAt(NamedTuple):
    """Pick each row's slot to evict by the new scores, as kernels/evict.py's `evict_slot`."""

    positions: mx.array  # [R, >= n] int32 true positions of the slots (a buffer: the first n are read)
    n_sink: int  # positions below it are protected
    recent_start: int  # and positions from it on


def scored_attention_reference(q, keys, values, n: int, scale: float, scores=None, noise: GumbelNoise | None = None,
                               evict: EvictAt | None = None):
    """q [R, G, D]; keys, values [R, >= n, D] (the first n slots are used); scores [R, n] float32 or None.

    Returns (out [R, G, D] in q's dtype, logits [R, G, n] float32, sums [R, n] float32, slot) where
    probs = softmax(logits) over the slots gives the output, and sums are the scores' probabilities
    summed over the G heads (+ scores if given): probs, or with `noise` softmax((logits + zeta) / tau);
    slot [R] int32: with `evict`, the slot `evict_slot` picks by the sums, else None. With `evict` the
    chosen slot's sum is then set to 0: the cache writes its next token there, and a token's score
    starts from zero (one scatter fewer per layer and step).
    """
    k, v = keys[:, :n], values[:, :n]
    logits = ((q * scale).astype(k.dtype) @ k.swapaxes(1, 2)).astype(mx.float32)  # [R, G, n]
    probs = mx.softmax(logits, axis=-1, precise=True)
    out = (probs.astype(v.dtype) @ v).astype(q.dtype)  # [R, G, D]
    if noise is not None:
        steps = None if noise.query_position is None else mx.array([noise.query_position], mx.int32)
        zeta = gumbel_noise_from_streams(noise.streams, steps, noise.positions[:, :n], fused=False)[:, :, 0]
        probs = mx.softmax((logits + zeta) / noise.tau, axis=-1, precise=True)
    sums = probs.sum(axis=1)
    if scores is not None:
        sums = scores + sums
    if evict is None:
        return out, logits, sums, None
    slot = evict_slot_reference(sums, evict.positions[:, :n], evict.n_sink, evict.recent_start)
    return out, logits, free_slot_zeroed(sums, slot), slot


_ZERO = mx.array(0.0, mx.float32)  # made once: a host-made array per call costs a GPU launch more


def free_slot_zeroed(sums, slot):
    """sums [R, >= n] with each row's `slot` [R] set to 0 (the score a token written there starts from)."""
    return mx.put_along_axis(sums, slot[:, None], _ZERO, axis=1)


def checked_slot(sums, slot, reference_sums, evict: EvictAt, what: str = "slot"):
    """For the fused kernels' sums [R, n] and slot [R] with `evict`: assert the slot is exactly the
    one evict_slot picks by the kernels' own sums (the chosen slot's zero put back from
    `reference_sums`, the reference's sums without `evict`, equal within rounding), and return
    `reference_sums` with that slot zeroed, to compare the kernels' sums with."""
    n = sums.shape[1]
    ranked = mx.put_along_axis(sums, slot[:, None], mx.take_along_axis(reference_sums, slot[:, None], axis=1), axis=1)
    dispatch.assert_equal([slot], [evict_slot_reference(ranked, evict.positions[:, :n], evict.n_sink, evict.recent_start)],
                          what)
    return free_slot_zeroed(reference_sums, slot)


# ---------------------------------------------------------------------------------------------
# kernels (one body per kernel for CUDA and Metal; the headers define the macros)

_ATTEND_BODY = """
    constexpr int NW = NT / 32;
    constexpr int C = D / 32;  // channels per lane: lane, lane + 32, ... (VEC: lane * C, ..., lane * C + C - 1)
    constexpr int GP = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8;  // heads padded to a power of two
    constexpr int UN = 32 / GP < MAX_UN ? 32 / GP : MAX_UN;  // slots per warp step
    constexpr int V = UN * GP;  // dot products per warp step, index u * GP + g
    constexpr int LV = V == 32 ? 5 : V == 16 ? 4 : V == 8 ? 3 : V == 4 ? 2 : V == 2 ? 1 : 0;  // log2(V)
    constexpr int LG = GP == 8 ? 3 : GP == 4 ? 2 : GP == 2 ? 1 : 0;
    constexpr int SHIFT = 5 - LV;  // lanes 2^SHIFT apart hold copies of the same dot product
    const int allocated = dims[1];
    const int per_block = dims[2];
    const float scale = params[0];
    const long kv_row = row * (long)allocated * D;
    // after the reduction below, lane l holds dot product (u, g) = (idx / GP, idx % GP), idx = l >> SHIFT
    const int idx = lane >> SHIFT;
    const int my_u = idx / GP;
    const int my_g = idx % GP;
    const bool writer = (lane & ((1 << SHIFT) - 1)) == 0;
    // NOISY (Keyformer): the scores' softmax is of (logit + Gumbel noise) / tau, the noise a hash of
    // this step's stream of the head and the key's true position (kvcompress/kernels/counter_hash.py)
    const unsigned int step_hash = NOISY && my_g < G ? mix32(streams[row * G + my_g] ^ (unsigned int)slot_dims[0]) : 0u;

    float qv[G][C];
    KV_UNROLL for (int g = 0; g < G; ++g) {
        KV_UNROLL for (int c = 0; c < C; ++c) qv[g][c] = (float)q[(row * G + g) * D + CHANNEL(c)] * scale;
    }
    float acc[G][C];
    KV_UNROLL for (int g = 0; g < G; ++g) {
        KV_UNROLL for (int c = 0; c < C; ++c) acc[g][c] = 0.0f;
    }
    float run_max = NEG_INF, run_sum = 0.0f;  // of head my_g (every lane of that head agrees)
    float noisy_max = NEG_INF, noisy_sum = 0.0f;  // NOISY: the same for the noisy logits
    KV_SHARED float shared_p[NW * V];  // a warp step's probabilities, index u * GP + g
    KV_SHARED float shared_rescale[NW * GP];
    const int start = blk * per_block;
    const int end = min(n, start + per_block);
    KV_NO_UNROLL for (int t0 = start + warp * UN; t0 < end; t0 += NW * UN) {
        // every load of the UN slots' keys and values first: they are in flight together (the
        // values do not depend on the probabilities, only their use does)
        T kh[UN][C], vh[UN][C];
        KV_UNROLL for (int u = 0; u < UN; ++u) {
            const long at = kv_row + (long)min(t0 + u, end - 1) * D;  // p is 0 past the end
            if (VEC) {  // one load of C consecutive channels per lane
                const Chunk<T, C> k_chunk = reinterpret_cast<const KV_DEVICE Chunk<T, C>*>(keys + at)[lane];
                const Chunk<T, C> v_chunk = reinterpret_cast<const KV_DEVICE Chunk<T, C>*>(values + at)[lane];
                KV_UNROLL for (int c = 0; c < C; ++c) {
                    kh[u][c] = k_chunk.v[c];
                    vh[u][c] = v_chunk.v[c];
                }
            } else {
                KV_UNROLL for (int c = 0; c < C; ++c) kh[u][c] = keys[at + CHANNEL(c)];
                KV_UNROLL for (int c = 0; c < C; ++c) vh[u][c] = values[at + CHANNEL(c)];
            }
        }
        float v[V];
        KV_UNROLL for (int u = 0; u < UN; ++u) {
            KV_UNROLL for (int g = 0; g < GP; ++g) {
                float dot = 0.0f;
                if (g < G) {
                    KV_UNROLL for (int c = 0; c < C; ++c) dot += qv[g < G ? g : 0][c] * (float)kh[u][c];
                }
                v[u * GP + g] = dot;
            }
        }
        // reduce-scatter over the warp: each halving step sends half of the partial sums to the lane
        // `m` away and adds the half it receives (31 shuffles for 32 sums where a butterfly per sum
        // took 160), so lane l ends with the whole sum of dot product l >> SHIFT
        KV_UNROLL for (int step = 0; step < LV; ++step) {
            const int half = V >> (step + 1);
            const int m = 16 >> step;
            const bool upper = (lane & m) != 0;
            // a constant trip count (V / 2, the steps past `half` skipped): with `i < half` the
            // compiler left this loop rolled at 8 heads, indexing v at run time, so v went to local
            // memory (a 128-byte stack frame; scripts/cuda_compile_check.py)
            KV_UNROLL for (int i = 0; i < V / 2; ++i) {
                if (i >= half) break;
                const float send = upper ? v[i] : v[i + half];
                const float keep = upper ? v[i + half] : v[i];
                v[i] = keep + SHFL_XOR(send, m);
            }
        }
        KV_UNROLL for (int m = 16 >> LV; m > 0; m /= 2) v[0] += SHFL_XOR(v[0], m);
        const bool valid = my_g < G && t0 + my_u < end;
        float s = v[0];
        if (valid && writer) logits[(row * G + my_g) * (long)n + t0 + my_u] = s;
        if (!valid) s = NEG_INF;
        // online softmax per head: the lanes of one head differ in the lane bits of u
        float top = s;
        KV_UNROLL for (int m = 1 << (LG + SHIFT); m < 32; m *= 2) top = FMAX(top, SHFL_XOR(top, m));
        top = FMAX(top, run_max);
        const float base = top == NEG_INF ? 0.0f : top;  // a padded head: nothing, and no NaN
        const float rescale = EXP2((run_max - base) * log2e);  // 0 on the first slots (max -inf)
        const float p = EXP2((s - base) * log2e);
        float added = p;
        KV_UNROLL for (int m = 1 << (LG + SHIFT); m < 32; m *= 2) added += SHFL_XOR(added, m);
        run_max = top;
        run_sum = run_sum * rescale + added;
        if (NOISY) {
            const float y = valid ? (s + gumbel(step_hash, (unsigned int)positions[row * (long)slot_dims[1] + t0 + my_u])) / tau : NEG_INF;
            float y_top = y;
            KV_UNROLL for (int m = 1 << (LG + SHIFT); m < 32; m *= 2) y_top = FMAX(y_top, SHFL_XOR(y_top, m));
            y_top = FMAX(y_top, noisy_max);
            const float y_base = y_top == NEG_INF ? 0.0f : y_top;
            float y_added = EXP2((y - y_base) * log2e);
            KV_UNROLL for (int m = 1 << (LG + SHIFT); m < 32; m *= 2) y_added += SHFL_XOR(y_added, m);
            noisy_sum = noisy_sum * EXP2((noisy_max - y_base) * log2e) + y_added;
            noisy_max = y_top;
        }
        if (writer) {
            shared_p[warp * V + idx] = p;
            if (my_u == 0) shared_rescale[warp * GP + my_g] = rescale;
        }
        WARP_SYNC();
        KV_UNROLL for (int g = 0; g < G; ++g) {
            const float r = shared_rescale[warp * GP + g];
            KV_UNROLL for (int c = 0; c < C; ++c) acc[g][c] *= r;
        }
        KV_UNROLL for (int u = 0; u < UN; ++u) {
            KV_UNROLL for (int g = 0; g < G; ++g) {
                const float pg = shared_p[warp * V + u * GP + g];
                KV_UNROLL for (int c = 0; c < C; ++c) acc[g][c] += pg * (float)vh[u][c];
            }
        }
        WARP_SYNC();  // the next step overwrites shared_p
    }

    // the block's warps meet in shared memory: (max, sum) per head, then the outputs
    KV_SHARED float w_max[NW * G];
    KV_SHARED float w_sum[NW * G];
    KV_SHARED float w_noisy_max[NW * G];
    KV_SHARED float w_noisy_sum[NW * G];
    KV_SHARED float w_acc[NW * G * D];
    if (writer && my_u == 0 && my_g < G) {
        w_max[warp * G + my_g] = run_max;
        w_sum[warp * G + my_g] = run_sum;
        w_noisy_max[warp * G + my_g] = noisy_max;
        w_noisy_sum[warp * G + my_g] = noisy_sum;
    }
    KV_UNROLL for (int g = 0; g < G; ++g) {
        KV_UNROLL for (int c = 0; c < C; ++c) w_acc[(warp * G + g) * D + CHANNEL(c)] = acc[g][c];
    }
    KV_BARRIER();
    const long part_row = (row * (long)nb + blk) * G;
    for (int i = tid; i < G * D; i += NT) {
        const int g = i / D;
        float top = NEG_INF;
        for (int w = 0; w < NW; ++w) top = FMAX(top, w_max[w * G + g]);
        float o = 0.0f, total = 0.0f;
        for (int w = 0; w < NW; ++w) {
            const float weight = w_max[w * G + g] == NEG_INF ? 0.0f : EXP2((w_max[w * G + g] - top) * log2e);
            o += weight * w_acc[w * G * D + i];
            total += weight * w_sum[w * G + g];
        }
        part[part_row * D + i] = o;
        if (i % D == 0) {
            stats[(part_row + g) * 4] = top;
            stats[(part_row + g) * 4 + 1] = total;
            float noisy_top = NEG_INF, noisy_total = 0.0f;
            if (NOISY) {
                for (int w = 0; w < NW; ++w) noisy_top = FMAX(noisy_top, w_noisy_max[w * G + g]);
                for (int w = 0; w < NW; ++w) {
                    const float m = w_noisy_max[w * G + g];
                    noisy_total += m == NEG_INF ? 0.0f : EXP2((m - noisy_top) * log2e) * w_noisy_sum[w * G + g];
                }
            }
            stats[(part_row + g) * 4 + 2] = noisy_top;
            stats[(part_row + g) * 4 + 3] = noisy_total;
        }
    }
"""

_FINISH_BODY = """
    KV_SHARED float final_max[G];
    KV_SHARED float inv_sum[G];
    KV_SHARED float noisy_max[G];  // NOISY: the scores' softmax (of the noisy logits) instead
    KV_SHARED float noisy_inv_sum[G];
    KV_SHARED float best_value[EVICT ? NT : 1];  // EVICT: each thread's candidate slot
    KV_SHARED int best_positions[EVICT ? NT : 1];
    KV_SHARED int best_slot[EVICT ? NT : 1];
    const long part_row = row * (long)nb * G;
    if (warp < G) {  // warp g: the softmax's max and sum for head g, the lanes striding the partials
        const int g = warp;
        KV_UNROLL for (int k = 0; k < (NOISY ? 2 : 1); ++k) {  // k 1: the noisy logits' softmax
            float top = NEG_INF;
            for (int b = lane; b < nb; b += 32) top = FMAX(top, stats[(part_row + b * G + g) * 4 + 2 * k]);
            KV_UNROLL for (int off = 16; off > 0; off /= 2) top = FMAX(top, SHFL_XOR(top, off));
            float total = 0.0f;
            for (int b = lane; b < nb; b += 32) {
                const float m = stats[(part_row + b * G + g) * 4 + 2 * k];
                total += m == NEG_INF ? 0.0f : EXP2((m - top) * log2e) * stats[(part_row + b * G + g) * 4 + 2 * k + 1];
            }
            KV_UNROLL for (int off = 16; off > 0; off /= 2) total += SHFL_XOR(total, off);
            if (lane == 0) {
                if (k == 0) {
                    final_max[g] = top;
                    inv_sum[g] = 1.0f / total;
                } else {
                    noisy_max[g] = top;
                    noisy_inv_sum[g] = 1.0f / total;
                }
            }
        }
    }
    KV_BARRIER();
    // the first G * D threads of the row's blocks (dims[4] of them) also combine the outputs
    for (int i = blk * NT + tid; i < G * D; i += NT * dims[4]) {
        const int g = i / D;
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four partials' loads in flight at once
        int b = 0;
        for (; b + 4 <= nb; b += 4) {
            KV_UNROLL for (int k = 0; k < 4; ++k) {
                o[k] += EXP2((stats[(part_row + (b + k) * G + g) * 4] - final_max[g]) * log2e) * part[(part_row + (b + k) * G) * D + i];
            }
        }
        for (; b < nb; ++b) o[0] += EXP2((stats[(part_row + b * G + g) * 4] - final_max[g]) * log2e) * part[(part_row + b * G) * D + i];
        out[row * G * D + i] = (T)((o[0] + o[1] + (o[2] + o[3])) * inv_sum[g]);
    }
    KV_SHARED unsigned int step_hash[G];  // NOISY: each head's noise stream at this step
    if (NOISY && tid < G) step_hash[tid] = mix32(streams[row * G + tid] ^ (unsigned int)slot_dims[0]);
    KV_BARRIER();
    // EVICT: one block holds the row and also picks the slot to evict by the new scores, as
    // kernels/evict.py's evict_slot does (the lowest unprotected score, ties to the lowest position)
    const int first = EVICT ? 0 : blk * SLOTS_PER_BLOCK;
    const int last = EVICT ? n : min(n, first + SLOTS_PER_BLOCK);
    const int n_sink = slot_dims[2];
    const int recent_start = slot_dims[3];
    float best = -NEG_INF;
    int best_position = 2147483647;
    int best_at = 0;
    for (int j = first + tid; j < last; j += NT) {
        float total = ACCUMULATE ? scores[row * (long)n + j] : 0.0f;
        const int position = NOISY || EVICT ? positions[row * (long)slot_dims[1] + j] : 0;
        KV_UNROLL for (int g = 0; g < G; ++g) {
            const float logit = logits[(row * G + g) * (long)n + j];
            if (NOISY) {
                total += EXP2(((logit + gumbel(step_hash[g], (unsigned int)position)) / tau - noisy_max[g]) * log2e) * noisy_inv_sum[g];
            } else {
                total += EXP2((logit - final_max[g]) * log2e) * inv_sum[g];
            }
        }
        sums[row * (long)n + j] = total;
        if (EVICT && position >= n_sink && position < recent_start
            && (total < best || (total == best && position < best_position))) {
            best = total;
            best_position = position;
            best_at = j;
        }
    }
    if (EVICT) {
        best_value[tid] = best;
        best_positions[tid] = best_position;
        best_slot[tid] = best_at;
        KV_BARRIER();
        for (int stride = NT / 2; stride > 0; stride /= 2) {
            if (tid < stride) {
                const float v = best_value[tid + stride];
                const int p = best_positions[tid + stride];
                if (v < best_value[tid] || (v == best_value[tid] && p < best_positions[tid])) {
                    best_value[tid] = v;
                    best_positions[tid] = p;
                    best_slot[tid] = best_slot[tid + stride];
                }
            }
            KV_BARRIER();
        }
        if (tid == 0) {
            slot_out[row] = best_slot[0];
            sums[row * (long)n + best_slot[0]] = 0.0f;  // the score the slot's next token starts from
        }
    }
"""

# what both kernels read first
_ARGUMENTS = """
    const int n = dims[0];
    const int nb = dims[3];
    const float tau = params[1];
    const float log2e = 1.4426950408889634f;
    const int lane = tid % 32;
    const int warp = tid / 32;
"""
_INDEX = {
    "cuda": "const int tid = threadIdx.x; const int blk = blockIdx.x; const long row = blockIdx.y;\n",
    "metal": "const int tid = (int)thread_position_in_threadgroup.x; const int blk = (int)threadgroup_position_in_grid.x;"
             " const long row = (long)threadgroup_position_in_grid.y;\n",
}
# Both backends: the channel a lane holds, and C consecutive elements as one load (VEC)
_CHANNELS = """
#define CHANNEL(c) (VEC ? lane * C + (c) : (c) * 32 + lane)
// aligned to the largest power of two dividing its size (D 96, 160, 224 give C = 3, 5, 7 channels)
template <typename X, int N> struct alignas((sizeof(X) * N) & (~(sizeof(X) * N) + 1)) Chunk { X v[N]; };
"""
# Per backend: a warp barrier, and Keyformer's noise exactly as counter_hash.py draws it (the
# "lowbias32" finalizer on uint32, u from the hash's top 24 bits, kept below 1, zeta = -log(-log(u)))
_EXTRA_HEADER = {
    "cuda": """
#define WARP_SYNC() __syncwarp()
__device__ __forceinline__ unsigned int mix32(unsigned int x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}
__device__ __forceinline__ float gumbel(unsigned int step_hash, unsigned int position) {
    const unsigned int h = mix32(step_hash ^ position);
    const float u = fminf(((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f), 1.0f - 5.9604644775390625e-08f);
    return -logf(-logf(u));
}
""",
    "metal": """
#define WARP_SYNC() simdgroup_barrier(mem_flags::mem_threadgroup)
inline unsigned int mix32(unsigned int x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}
inline float gumbel(unsigned int step_hash, unsigned int position) {
    const unsigned int h = mix32(step_hash ^ position);
    const float u = metal::fmin(((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f), 1.0f - 5.9604644775390625e-08f);
    return -metal::precise::log(-metal::precise::log(u));
}
""",
}
_kernels = dispatch.kernel_cache()


def kernel_source(which: str, backend: str) -> str:
    """The body MLX compiles for kernel `which` ("attend" or "finish") on `backend`."""
    return _INDEX[backend] + _ARGUMENTS + (_ATTEND_BODY if which == "attend" else _FINISH_BODY)


def _kernel(which: str, backend: str):
    key = (which, backend)
    if key not in _kernels:
        shared = ["streams", "positions", "slot_dims"]  # the noise, the slots' positions, small ints
        if which == "attend":
            inputs, outputs = ["q", "keys", "values", "dims", "params", *shared], ["logits", "part", "stats"]
        else:
            inputs, outputs = ["part", "stats", "logits", "scores", "dims", "params", *shared], ["out", "sums", "slot_out"]
        header = (CUDA_HEADER if backend == "cuda" else METAL_HEADER) + _EXTRA_HEADER[backend] + _CHANNELS + (
            f"#define SLOTS_PER_BLOCK {SLOTS_PER_FINISH_BLOCK}\n")
        source = kernel_source(which, backend)
        _kernels[key] = dispatch.fast_kernel(backend, f"scored_{which}", source, header, inputs, outputs)
    return _kernels[key]


def default_blocks(n: int, rows: int) -> int:
    """Chunks per row: ~384 blocks in all, about one wave on an H200 (132 SMs, 3 blocks each:
    registers bound them; 48 and 96 chunks per row of 8 rows measured alike, 128 slower), at least
    64 slots each."""
    return max(1, min(-(-n // 64), -(-384 // rows)))


class LaunchPlan(NamedTuple):
    """Everything the two launches take besides the arrays: small int/float arguments and grids."""

    dims: tuple  # int32: slots n, allocated slots, slots per chunk, chunks per row nb, finish blocks per row
    params: tuple  # float32: softmax scale, tau (1 without noise)
    slot_dims: tuple  # int32: the noise step's hash input (uint32 bits as int32), the positions' row
    # stride, n_sink, recent start
    chunks: int  # `attend` blocks per row
    finish_blocks: int  # `finish` blocks per row
    finish_threads: int


def launch_plan(n: int, rows: int, group: int, head_dim: int, allocated: int, scale: float,
                noise: GumbelNoise | None = None, evict: EvictAt | None = None, blocks: int | None = None) -> LaunchPlan:
    nb = blocks or default_blocks(n, rows)
    per_block = -(-n // nb)
    nb = -(-n // per_block)
    step, tau = 0, 1.0
    if noise is not None:
        step = 0 if noise.query_position is None else (noise.query_position + 1) % 2**32  # as counter_hash
        step, tau = (step - 2**32 if step >= 2**31 else step), noise.tau
    positions = noise.positions if noise is not None else evict.positions if evict is not None else None
    stride = 0 if positions is None else positions.shape[1]
    bounds = (0, 0) if evict is None else (evict.n_sink, evict.recent_start)
    if evict is not None:  # one block holds the row (it picks the row's slot)
        finish_blocks, finish_threads = 1, EVICT_THREADS
    else:  # enough blocks for every slot and for the G * D outputs (one thread each)
        finish_threads = FINISH_THREADS
        finish_blocks = max(-(-n // SLOTS_PER_FINISH_BLOCK), -(-group * head_dim // FINISH_THREADS))
    return LaunchPlan((n, allocated, per_block, nb, finish_blocks), (scale, tau), (step, stride, *bounds), nb,
                      finish_blocks, finish_threads)


def scored_attention_fused(q, keys, values, n: int, scale: float, scores=None, noise: GumbelNoise | None = None,
                           evict: EvictAt | None = None, backend: str = "cuda", blocks: int | None = None,
                           vec_loads: bool = VEC_LOADS, max_unroll: int = MAX_UNROLL):
    """The two kernels; the same contract as `scored_attention_reference` for supported inputs."""
    R, G, D = q.shape
    if backend == "metal" and not metal_fits(G, D, max_unroll):
        raise ValueError(f"the Metal kernel takes at most {dispatch.METAL_THREADGROUP_MEMORY} bytes of threadgroup "
                         f"memory: {attend_threadgroup_bytes(G, D, max_unroll)} at {G} heads, D {D}")
    plan = launch_plan(n, R, G, D, keys.shape[1], scale, noise, evict, blocks)
    dims, params = dispatch.constant(plan.dims, mx.int32), dispatch.constant(plan.params, mx.float32)
    slot_dims = dispatch.constant(plan.slot_dims, mx.int32)
    streams = noise.streams if noise is not None else dispatch.constant((0,), mx.uint32)  # placeholders: not read
    positions = noise.positions if noise is not None else evict.positions if evict is not None else \
        dispatch.constant((0,), mx.int32)
    flags = [("NOISY", noise is not None)]
    logits, part, stats = _kernel("attend", backend)(
        inputs=[q, keys, values, dims, params, streams, positions, slot_dims],
        template=[("T", q.dtype), ("D", D), ("G", G), ("NT", THREADS), ("VEC", vec_loads), ("MAX_UN", max_unroll),
                  *flags],
        grid=(plan.chunks * THREADS, R, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(R, G, n), (R, plan.chunks, G, D), (R, plan.chunks, G, 4)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    out, sums, slot = _kernel("finish", backend)(
        inputs=[part, stats, logits, scores if scores is not None else dispatch.constant((0.0,), mx.float32), dims,
                params, streams, positions, slot_dims],
        template=[("T", q.dtype), ("D", D), ("G", G), ("NT", plan.finish_threads), ("ACCUMULATE", scores is not None),
                  ("EVICT", evict is not None), *flags],
        grid=(plan.finish_blocks * plan.finish_threads, R, 1),
        threadgroup=(plan.finish_threads, 1, 1),
        output_shapes=[(R, G, D), (R, n), (R,)],
        output_dtypes=[q.dtype, mx.float32, mx.int32],
    )
    return out, logits, sums, slot if evict is not None else None


def shape_supported(group: int, head_dim: int, query_dtype, kv_dtype) -> bool:
    """Whether the kernels cover a layer of this geometry (see the module docstring)."""
    return (
        head_dim % 32 == 0 and head_dim <= 256 and 1 <= group <= MAX_GROUP
        and query_dtype == kv_dtype and query_dtype in (mx.float16, mx.bfloat16, mx.float32)
    )


def supported(q, keys, values, n: int, scores=None, noise: GumbelNoise | None = None, evict: EvictAt | None = None) -> bool:
    R, G, D = q.shape
    positions = [a.positions for a in (noise, evict) if a is not None]
    return (
        shape_supported(G, D, q.dtype, keys.dtype) and n >= 1 and keys.dtype == values.dtype
        and keys.shape == values.shape and keys.shape[0] == R and keys.shape[2] == D and keys.shape[1] >= n
        and (scores is None or (scores.shape == (R, n) and scores.dtype == mx.float32))
        and (noise is None or (scores is not None and noise.streams.shape == (R, G) and noise.streams.dtype == mx.uint32))
        and (evict is None or scores is not None)  # the new scores pick the slot: an accumulating method
        and all(p.dtype == mx.int32 and p.shape[0] == R and p.shape[1] >= n for p in positions)
        and all(p is positions[0] for p in positions)  # one positions buffer for the noise and the choice
    )


# float32 accumulation everywhere; the gap to the reference is the reference's own rounding
_SELFTEST_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


def random_case(R: int, G: int, D: int, n: int, allocated: int, dtype, seed: int = 0):
    """q [R, G, D], keys and values [R, allocated, D] (spare slots hold garbage), scores [R, n]."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((R, G, D), key=k1).astype(dtype)
    keys = (3 * mx.random.normal((R, allocated, D), key=k2)).astype(dtype)
    values = mx.random.normal((R, allocated, D), key=k3).astype(dtype)
    scores = mx.random.uniform(shape=(R, n), key=k4) * 50
    return q, keys, values, scores


def random_noise(R: int, G: int, allocated: int, redraw: bool = True, seed: int = 0) -> GumbelNoise:
    """Keyformer-like noise: the streams of layer `seed`, slots holding shuffled true positions."""
    positions = mx.argsort(mx.random.uniform(shape=(R, allocated), key=mx.random.key(seed)), axis=1).astype(mx.int32)
    streams = noise_streams(seed, 3, mx.arange(R * G, dtype=mx.uint32).reshape(R, G))
    return GumbelNoise(streams, positions, allocated + 17 if redraw else None, 1.37)


def selftest(backend: str, dtype, variant: tuple) -> None:
    G, D, accumulate, noisy, evicts = variant
    q, keys, values, scores = random_case(3, G, D, 1000, 1100, dtype, seed=1)
    given = scores if accumulate else None
    noise = random_noise(3, G, 1100, seed=2) if noisy else None
    positions = noise.positions if noise is not None else random_noise(3, G, 1100, seed=2).positions
    evict = EvictAt(positions, 5, 1050) if evicts else None
    got = scored_attention_fused(q, keys, values, 1000, D**-0.5, given, noise, evict, backend, blocks=5)
    with mx.stream(mx.cpu):  # float32 on the CPU: a GPU matmul may round through TF32
        want = scored_attention_reference(q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32),
                                          1000, D**-0.5, given, noise)
        mx.eval(want)
    sums = want[2] if evict is None else checked_slot(got[2], got[3], want[2], evict, "scored_attention self-test (slot)")
    tolerance = _SELFTEST_TOLERANCE[dtype]
    for what, a, b, tol in zip(("output", "logits", "sums"), got, (*want[:2], sums), (tolerance, 1e-5, 1e-5)):
        dispatch.assert_close(a, b, tol, f"scored_attention self-test ({what})")


def attend_threadgroup_bytes(G: int, D: int, max_unroll: int = MAX_UNROLL) -> int:
    """Bytes of `attend`'s threadgroup arrays (_ATTEND_BODY): a warp step's probabilities and rescales,
    then each warp's statistics and outputs per head."""
    NW = THREADS // 32
    GP = 1 if G <= 1 else 2 if G <= 2 else 4 if G <= 4 else 8
    UN = min(32 // GP, max_unroll)
    return 4 * (NW * UN * GP + NW * GP + 4 * NW * G + NW * G * D)


def metal_fits(G: int, D: int, max_unroll: int = MAX_UNROLL) -> bool:
    """Whether `attend` fits a Metal threadgroup (32 KiB): all supported shapes but 8 heads at D 256
    (33920 bytes; CUDA's 48 KiB take it)."""
    return attend_threadgroup_bytes(G, D, max_unroll) <= dispatch.METAL_THREADGROUP_MEMORY


def _backend(q, accumulate: bool, noisy: bool, evicts: bool) -> str | None:
    if not metal_fits(q.shape[1], q.shape[2]) and dispatch.gpu_backend() == "metal":  # (the cheap test first)
        dispatch.record_reference("scored_attention", q.dtype)
        return None
    variant = (q.shape[1], q.shape[2], accumulate, noisy, evicts)
    return dispatch.select("scored_attention", q.dtype, variant, lambda b: selftest(b, q.dtype, variant))


def fuses(q, accumulate: bool, noisy: bool, evicts: bool) -> bool:
    """Whether `scored_attention` runs fused for queries like q [R, G, D] and these options here
    (self-test on first use): callers with a faster route than the reference for an option take it
    where the option's kernels do not run."""
    return shape_supported(q.shape[1], q.shape[2], q.dtype, q.dtype) and _backend(q, accumulate, noisy, evicts) is not None


def scored_attention(q, keys, values, n: int, scale: float, scores=None, noise: GumbelNoise | None = None,
                     evict: EvictAt | None = None):
    """Decode attention with scores (and the slot to evict): the fused kernels where they apply and
    passed their self-test on this machine, else the MLX reference (see the module docstring)."""
    if supported(q, keys, values, n, scores, noise, evict):
        backend = _backend(q, scores is not None, noise is not None, evict is not None)
        if backend is not None:
            return scored_attention_fused(q, keys, values, n, scale, scores, noise, evict, backend)
    else:
        dispatch.record_reference("scored_attention", q.dtype)
    return scored_attention_reference(q, keys, values, n, scale, scores, noise, evict)

