-- Summary: per sweep x config (method, budget, bits, tau_init, tau_end) x dataset x task x context.
-- score_mean: task score (RULER recall, passkey exact match, LongBench metric; lm: exp(-mean NLL)),
--   with its 95% Wilson interval score_ci_low..score_ci_high (see run_scores.sql) and the full
--   cache's mean score on the same samples (score_full_mean); score_vs_full is the paired mean of
--   score - full score over the runs whose sample the full cache also ran.
-- kl_mean: mean over runs of the per-run mean KL(full || method) in nats; top1_agree: share of
--   steps whose argmax matches the full cache; kv_ratio_to_full: resident KV bytes over the full
--   cache's, same tokens. Needs views.sql and run_scores.sql.
WITH config_cells AS (
    SELECT sweep_id, method, budget, bits, tau_init, tau_end, dataset, task, context_tokens,
           any_value(config_label) AS config_label,
           count(*) AS runs,
           avg(score) AS score_mean,
           min(score) >= 0 AND max(score) <= 1 AS score_in_unit_range,
           avg(score_full) AS score_full_mean,
           avg(score - score_full) AS score_vs_full,
           avg(kl_mean) AS kl_mean,
           avg(top1_agree) AS top1_agree,
           CAST(avg(live_kv_bytes) AS BIGINT) AS live_kv_bytes,
           avg(kv_ratio_to_full) AS kv_ratio_to_full,
           avg(decode_tok_s) AS decode_tok_s
    FROM run_scores
    GROUP BY sweep_id, method, budget, bits, tau_init, tau_end, dataset, task, context_tokens
)
SELECT sweep_id, method, budget, bits, tau_init, tau_end, dataset, task, context_tokens,
       runs, score_mean,
       CASE WHEN score_in_unit_range THEN wilson_low(score_mean, runs) END AS score_ci_low,
       CASE WHEN score_in_unit_range THEN wilson_high(score_mean, runs) END AS score_ci_high,
       score_full_mean, score_vs_full,
       kl_mean, top1_agree, live_kv_bytes, kv_ratio_to_full, decode_tok_s, config_label
FROM config_cells
ORDER BY sweep_id, dataset, task, context_tokens, method,
         budget NULLS FIRST, bits NULLS FIRST, tau_init NULLS FIRST, tau_end NULLS FIRST;
