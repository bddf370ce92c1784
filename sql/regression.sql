-- Nightly regressions: configs whose metrics moved beyond a threshold between the previous
-- scheduled sweep (sweep_a) and this one (sweep_b). Reads the view `sweep_comparison`, which is
-- compare_sweeps.sql as a view (tasks/regression.py creates it; in the DuckDB CLI:
--   SET VARIABLE sweep_a = '...'; SET VARIABLE sweep_b = '...';
--   CREATE TEMP VIEW sweep_comparison AS <the query of compare_sweeps.sql>;).
-- Thresholds (variables, defaults in brackets):
--   score_drop   [0.10]  absolute drop of the mean task score
--   kl_rise      [0.01]  rise of mean per-step KL in nats, and at least 50% of the previous value
--   top1_drop    [0.05]  drop of top-1 agreement with the full cache
--   memory_change[0.01]  relative change of live KV bytes (either way: memory is deterministic)
-- Decode speed is reported (decode_tok_s_delta) but not flagged: it is too noisy on shared machines.
WITH thresholds AS (
    SELECT coalesce(getvariable('score_drop'), 0.10) AS score_drop,
           coalesce(getvariable('kl_rise'), 0.01) AS kl_rise,
           coalesce(getvariable('top1_drop'), 0.05) AS top1_drop,
           coalesce(getvariable('memory_change'), 0.01) AS memory_change
),
flagged AS (
    SELECT c.*,
           coalesce(c.score_delta < -t.score_drop, false) AS score_regressed,
           coalesce(c.kl_delta > greatest(t.kl_rise, 0.5 * c.kl_mean_a), false) AS kl_regressed,
           coalesce(c.top1_agree_delta < -t.top1_drop, false) AS top1_regressed,
           coalesce(abs(c.live_kv_bytes_delta) > t.memory_change * c.live_kv_bytes_a, false) AS memory_changed,
           (c.runs_a IS NULL OR c.runs_b IS NULL) AS config_added_or_removed
    FROM sweep_comparison AS c, thresholds AS t
)
SELECT sweep_a, sweep_b, config_label, dataset, task, context_tokens,
       score_regressed OR kl_regressed OR top1_regressed OR memory_changed OR config_added_or_removed AS regressed,
       score_regressed, kl_regressed, top1_regressed, memory_changed, config_added_or_removed,
       score_mean_a, score_mean_b, score_delta, score_delta_beyond_ci,
       kl_mean_a, kl_mean_b, kl_delta, top1_agree_a, top1_agree_b, top1_agree_delta,
       live_kv_bytes_a, live_kv_bytes_b, live_kv_bytes_delta, decode_tok_s_a, decode_tok_s_b, decode_tok_s_delta,
       method, budget, bits, tau_init, tau_end
FROM flagged
ORDER BY regressed DESC, dataset, task, context_tokens, config_label;
