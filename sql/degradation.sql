-- Per-step degradation: how far each config drifts from the full cache as decoding goes on.
-- Per sweep x config x decode step, over every ok run that recorded that step (all datasets and
-- context lengths): kl_mean / kl_max = KL(full || method) in nats, top1_agree = share of runs whose
-- argmax equals the full cache's next token, nll_mean = -log p_method(ref token) in nats.
-- A flat kl_mean curve means the compression error does not compound; a rising one means it does.
-- protocol: a function of config_label, there to filter by.
-- Needs views.sql and run_scores.sql.
WITH run_steps AS (
    SELECT r.sweep_id, r.method, r.budget, r.bits, r.tau_init, r.tau_end, r.protocol, r.config_label,
           s.step, s.kl, s.top1_agree, s.nll, s.logit_cosine, s.tokens_kept, s.live_kv_bytes
    FROM run_scores AS r
    JOIN steps AS s USING (sweep_id, run_id)
)
SELECT sweep_id, method, budget, bits, tau_init, tau_end, step,
       count(*) AS runs,
       avg(kl) AS kl_mean,
       max(kl) AS kl_max,
       avg(CASE WHEN top1_agree THEN 1.0 ELSE 0.0 END) AS top1_agree,
       avg(nll) AS nll_mean,
       avg(logit_cosine) AS logit_cosine_mean,
       avg(tokens_kept) AS tokens_kept_mean,
       avg(live_kv_bytes) AS live_kv_bytes_mean,
       protocol, config_label
FROM run_steps
GROUP BY sweep_id, method, budget, bits, tau_init, tau_end, protocol, config_label, step
ORDER BY sweep_id, method, budget NULLS FIRST, bits NULLS FIRST, tau_init NULLS FIRST,
         tau_end NULLS FIRST, step;
