-- Throughput at equal KV memory (the speed sweep, docs/speed.md): per sweep x model x context x
-- KV budget (or given batch), each cache's batch, its KV and decode tok/s, and x_full: its tok/s over
-- the full cache's in the same group and round (the caches took turns in every round, so the
-- machine's drift falls on both alike), as the median over the rounds with their min and max.
-- Under a budget every cache runs its largest batch whose KV after the prompt fits (kv_budget_gib);
-- with given batches (kv_budget_gib null) every cache runs the same batch.
-- decode_tok_s: synchronous, sequences x steps per second; pipelined_tok_s: as mlx_lm.generate runs;
-- host_ms: building a step's graph; prefill_s: the batch's prefill (time to first token).
-- Needs speed_views.sql.
WITH measured AS (
    SELECT *, coalesce('kv ' || kv_budget_bytes, 'batch ' || batch) AS setting
    FROM speed
    WHERE status = 'ok'
),
full_cache AS (
    SELECT sweep_id, model, dtype, device, context_tokens, setting, round,
           decode_tok_s AS full_tok_s, pipelined_tok_s AS full_pipelined_tok_s
    FROM measured
    WHERE method = 'full'
),
per_round AS (
    SELECT m.*, m.decode_tok_s / f.full_tok_s AS x_full, m.pipelined_tok_s / f.full_pipelined_tok_s AS x_full_pipelined
    FROM measured AS m
    LEFT JOIN full_cache AS f USING (sweep_id, model, dtype, device, context_tokens, setting, round)
)
SELECT sweep_id, model, context_tokens,
       kv_budget_bytes / 2 ^ 30 AS kv_budget_gib,
       config_label,
       max(batch) AS batch,
       max(live_kv_bytes) / 2 ^ 30 AS live_kv_gib,
       count(decode_tok_s) AS rounds,
       median(decode_tok_s) AS decode_tok_s,
       min(decode_tok_s) AS decode_tok_s_min,
       max(decode_tok_s) AS decode_tok_s_max,
       median(x_full) AS x_full,
       min(x_full) AS x_full_min,
       max(x_full) AS x_full_max,
       median(pipelined_tok_s) AS pipelined_tok_s,
       median(x_full_pipelined) AS x_full_pipelined,
       median(host_ms) AS host_ms,
       median(prefill_s) AS prefill_s,
       max(kv_bytes_per_sequence) / 2 ^ 20 AS kv_mib_per_sequence,
       max(peak_memory_bytes) / 2 ^ 30 AS peak_memory_gib,
       method, dtype, device
FROM per_round
GROUP BY sweep_id, model, dtype, device, context_tokens, kv_budget_bytes, setting, method, config_label
ORDER BY sweep_id, model, context_tokens, kv_budget_bytes NULLS FIRST, setting, method <> 'full', x_full DESC NULLS LAST,
         config_label;
