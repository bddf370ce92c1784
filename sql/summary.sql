-- Summary: per sweep x config (config_label; see run_scores.sql) x dataset x task x context.
-- score_mean: task score (RULER recall, passkey exact match, LongBench metric; lm: exp(-mean NLL)),
--   with its 95% Wilson interval score_ci_low..score_ci_high (see run_scores.sql) and the full
--   cache's mean score on the same samples (score_full_mean); score_vs_full is the paired mean of
--   score - full score over the runs whose sample the full cache also ran.
-- kernels: the path each kernel took in these runs ("kernel/backend/dtype fused|reference", from
--   config.kernels; ' | ' between runs that took different paths), NULL where none ran or none recorded.
-- quantizes_nothing: a quantizer (alone or storing an eviction's kept tokens) that held no token as
--   codes in any run (runs.quantized_tokens = 0): not a point of its own, its numbers are the
--   unquantized cache's; NULL for configs that quantize nothing by design.
-- kl_mean: mean over runs of the per-run mean KL(full || method) in nats; top1_agree: share of
--   steps whose argmax matches the full cache; kv_ratio_to_full: resident KV bytes over the full
--   cache's, same tokens. Needs views.sql and run_scores.sql (the config_scores view).
SELECT sweep_id, method, budget, bits, tau_init, tau_end, protocol, dataset, task, context_tokens,
       runs, score_mean, score_ci_low, score_ci_high, score_full_mean, score_vs_full,
       kl_mean, top1_agree, CAST(live_kv_bytes AS BIGINT) AS live_kv_bytes, kv_ratio_to_full,
       decode_tok_s, config_label, kernels, quantizes_nothing
FROM config_scores
ORDER BY sweep_id, protocol, dataset, task, context_tokens, method,
         budget NULLS FIRST, bits NULLS FIRST, tau_init NULLS FIRST, tau_end NULLS FIRST;
