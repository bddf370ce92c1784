-- Two sweeps side by side, per config x dataset x task x context length:
--   SET VARIABLE sweep_a = 'baseline';  SET VARIABLE sweep_b = 'candidate';
-- Unset, sweep_b is the sweep with the newest run and sweep_a the next newest, so "what changed
-- since last time" needs no setup. A config present in one sweep only gets NULLs on the other side.
-- *_delta = b - a. score_delta_beyond_ci is true when the two 95% Wilson intervals do not overlap
-- (see run_scores.sql): a conservative test, so false means "could be noise", not "same".
-- score_full_mean_a/_b: the full cache on the same samples in each sweep, to tell a method change
-- from a model or data change. Needs views.sql and run_scores.sql.
WITH sweep_recency AS (
    SELECT sweep_id, max(created_at) AS last_run_at
    FROM runs
    GROUP BY sweep_id
),
chosen AS (
    SELECT coalesce(getvariable('sweep_b'),
                    (SELECT sweep_id FROM sweep_recency ORDER BY last_run_at DESC, sweep_id DESC LIMIT 1))
               AS sweep_b
),
chosen_pair AS (
    SELECT coalesce(getvariable('sweep_a'),
                    (SELECT sweep_id FROM sweep_recency, chosen
                     WHERE sweep_id <> chosen.sweep_b
                     ORDER BY last_run_at DESC, sweep_id DESC LIMIT 1)) AS sweep_a,
           sweep_b
    FROM chosen
),
side_a AS (SELECT * FROM config_scores WHERE sweep_id = (SELECT sweep_a FROM chosen_pair)),
side_b AS (SELECT * FROM config_scores WHERE sweep_id = (SELECT sweep_b FROM chosen_pair))
SELECT (SELECT sweep_a FROM chosen_pair) AS sweep_a,
       (SELECT sweep_b FROM chosen_pair) AS sweep_b,
       coalesce(a.method, b.method) AS method,
       coalesce(a.budget, b.budget) AS budget,
       coalesce(a.bits, b.bits) AS bits,
       coalesce(a.tau_init, b.tau_init) AS tau_init,
       coalesce(a.tau_end, b.tau_end) AS tau_end,
       coalesce(a.dataset, b.dataset) AS dataset,
       coalesce(a.task, b.task) AS task,
       coalesce(a.context_tokens, b.context_tokens) AS context_tokens,
       a.runs AS runs_a, b.runs AS runs_b,
       a.score_mean AS score_mean_a, b.score_mean AS score_mean_b,
       b.score_mean - a.score_mean AS score_delta,
       a.score_ci_low AS score_ci_low_a, a.score_ci_high AS score_ci_high_a,
       b.score_ci_low AS score_ci_low_b, b.score_ci_high AS score_ci_high_b,
       a.score_ci_high < b.score_ci_low OR b.score_ci_high < a.score_ci_low AS score_delta_beyond_ci,
       a.score_full_mean AS score_full_mean_a, b.score_full_mean AS score_full_mean_b,
       a.kl_mean AS kl_mean_a, b.kl_mean AS kl_mean_b, b.kl_mean - a.kl_mean AS kl_delta,
       a.top1_agree AS top1_agree_a, b.top1_agree AS top1_agree_b,
       b.top1_agree - a.top1_agree AS top1_agree_delta,
       a.live_kv_bytes AS live_kv_bytes_a, b.live_kv_bytes AS live_kv_bytes_b,
       b.live_kv_bytes - a.live_kv_bytes AS live_kv_bytes_delta,
       a.decode_tok_s AS decode_tok_s_a, b.decode_tok_s AS decode_tok_s_b,
       b.decode_tok_s - a.decode_tok_s AS decode_tok_s_delta,
       coalesce(a.config_label, b.config_label) AS config_label
FROM side_a AS a
FULL OUTER JOIN side_b AS b
    ON  a.method = b.method
    AND a.budget IS NOT DISTINCT FROM b.budget
    AND a.bits IS NOT DISTINCT FROM b.bits
    AND a.tau_init IS NOT DISTINCT FROM b.tau_init
    AND a.tau_end IS NOT DISTINCT FROM b.tau_end
    AND a.config_label = b.config_label
    AND a.dataset = b.dataset AND a.task = b.task AND a.context_tokens = b.context_tokens
ORDER BY dataset, task, context_tokens, method, budget NULLS FIRST, bits NULLS FIRST,
         tau_init NULLS FIRST, tau_end NULLS FIRST;
