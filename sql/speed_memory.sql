-- Speed and memory: per sweep x config x dataset x context length.
-- decode_ms_p50 / decode_ms_p90: median and 90th percentile of steps.step_ms over every decode step
--   of every ok run in the cell (quantile_cont: linear interpolation between the two nearest ranks).
-- prefill_s_mean: shared full prefill + this config's compression, seconds; decode_tok_s: mean of
--   the runs' teacher-forced steps per second. live_kv_bytes / full_kv_bytes: mean resident KV bytes
--   after the last step, this config's and the full cache's on the same tokens; kv_ratio_to_full is
--   the mean per-run ratio. peak_memory_bytes_max: the largest process peak seen in the cell.
-- Needs views.sql and run_scores.sql.
WITH step_times AS (
    SELECT s.sweep_id, s.run_id,
           list(s.step_ms) AS step_ms_list
    FROM steps AS s
    GROUP BY ALL
),
cells AS (
    SELECT r.sweep_id, r.method, r.budget, r.bits, r.tau_init, r.tau_end, r.dataset, r.context_tokens,
           r.config_label,
           count(*) AS runs,
           flatten(list(t.step_ms_list)) AS step_ms_all,
           avg(r.prefill_s) AS prefill_s_mean,
           avg(r.decode_tok_s) AS decode_tok_s,
           avg(r.live_kv_bytes) AS live_kv_bytes,
           avg(r.full_kv_bytes) AS full_kv_bytes,
           avg(r.kv_ratio_to_full) AS kv_ratio_to_full,
           max(r.peak_memory_bytes) AS peak_memory_bytes_max
    FROM run_scores AS r
    LEFT JOIN step_times AS t USING (sweep_id, run_id)
    GROUP BY r.sweep_id, r.method, r.budget, r.bits, r.tau_init, r.tau_end, r.config_label, r.dataset, r.context_tokens
)
SELECT sweep_id, method, budget, bits, tau_init, tau_end, dataset, context_tokens, runs,
       list_aggregate(step_ms_all, 'quantile_cont', 0.5) AS decode_ms_p50,
       list_aggregate(step_ms_all, 'quantile_cont', 0.9) AS decode_ms_p90,
       prefill_s_mean, decode_tok_s,
       CAST(round(live_kv_bytes) AS BIGINT) AS live_kv_bytes,
       CAST(round(full_kv_bytes) AS BIGINT) AS full_kv_bytes,
       kv_ratio_to_full, peak_memory_bytes_max, config_label
FROM cells
ORDER BY sweep_id, dataset, context_tokens, method, budget NULLS FIRST, bits NULLS FIRST,
         tau_init NULLS FIRST, tau_end NULLS FIRST;
