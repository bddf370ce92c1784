-- Derived view and macros every report reads. Run after views.sql:
--   SET VARIABLE kv_results = 'results';  .read sql/views.sql  .read sql/run_scores.sql
--
-- A CONFIG is one config_label: the method, its budget/bits/tau and every other parameter that
-- differs from its default, and the protocol when query-agnostic (two Keyformer configs that differ
-- only in `score` are two configs). Reports group by config_label; the method, budget, bits,
-- tau_init and tau_end columns ride along for sorting and plotting (all are functions of the
-- label). Those columns are NULL where a method has no such knob (the full cache has no budget):
-- GROUP BY treats NULLs as equal; joins use config_label, or IS NOT DISTINCT FROM, never `=` on them.
--
-- Confidence interval: the Wilson score interval (Wilson 1927) at 95% (z = 1.959964) of the mean
-- score p over n runs, treating each run as one Bernoulli trial. Exact for 0/1 scores (passkey exact
-- match, RULER recall of one needle); for fractional scores in [0, 1] a run's variance is at most
-- p(1-p), so the interval is conservative. Scores outside [0, 1] get no interval (NULL).
--   centre = (p + z^2/(2n)) / (1 + z^2/n)
--   half   = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/(4n^2))
CREATE OR REPLACE MACRO wilson_low(p, n) AS
    (p + 1.959963984540054 ^ 2 / (2 * n)) / (1 + 1.959963984540054 ^ 2 / n)
    - 1.959963984540054 / (1 + 1.959963984540054 ^ 2 / n)
      * sqrt(p * (1 - p) / n + 1.959963984540054 ^ 2 / (4 * n * n));

CREATE OR REPLACE MACRO wilson_high(p, n) AS
    (p + 1.959963984540054 ^ 2 / (2 * n)) / (1 + 1.959963984540054 ^ 2 / n)
    + 1.959963984540054 / (1 + 1.959963984540054 ^ 2 / n)
      * sqrt(p * (1 - p) / n + 1.959963984540054 ^ 2 / (4 * n * n));

-- run_scores: one row per finished run with status 'ok', with its per-step means and the score
-- of the full cache on the SAME sample (same sweep, model, dataset, task, context length, sample id
-- and protocol), so every report can set a method against the ceiling it could have reached.
CREATE OR REPLACE VIEW run_scores AS
WITH step_stats AS (
    SELECT sweep_id, run_id,
           avg(kl) AS kl_mean,
           avg(CASE WHEN top1_agree THEN 1.0 ELSE 0.0 END) AS top1_agree,
           count(*) AS steps_recorded
    FROM steps
    GROUP BY ALL
),
ok_runs AS (
    -- runs written before protocols existed were query-aware
    SELECT r.* REPLACE (coalesce(r.protocol, 'query_aware') AS protocol), s.kl_mean, s.top1_agree, s.steps_recorded
    FROM runs AS r
    LEFT JOIN step_stats AS s USING (sweep_id, run_id)
    WHERE r.status = 'ok'
),
full_cache_scores AS (
    -- avg: a sample run twice under the full cache (e.g. two prefill chunkings) counts once
    SELECT sweep_id, model, dataset, task, context_tokens, sample_id, protocol, avg(score) AS score_full
    FROM ok_runs
    WHERE method = 'full'
    GROUP BY ALL
)
SELECT o.* EXCLUDE (config_label),
       f.score_full,
       -- the path each kernel took ("kivi_decode_attention/cpu/float32 fused, ..."): config.kernels,
       -- as the runner records it (dispatch.paths_used()); NULL where no kernel ran or none was recorded
       nullif(array_to_string([e.key || ' ' || e.value FOR e IN
           map_entries(CAST(json_extract(o.config, '$.kernels') AS MAP(VARCHAR, VARCHAR)))], ', '), '') AS kernel_paths,
       o.live_kv_bytes / nullif(o.full_kv_bytes, 0) AS kv_ratio_to_full,
       -- a quantizer that held no token as codes after the prompt (all in its full-precision window):
       -- its numbers are the unquantized cache's, in more bytes; NULL where nothing quantizes by design
       o.quantized_tokens = 0 AS quantizes_nothing,
       coalesce(o.config_label,  -- written by the runner; rebuilt from the grid columns otherwise
                concat_ws(' ', o.method,
                          'budget=' || printf('%g', o.budget),
                          'bits=' || printf('%g', o.bits),
                          CASE WHEN o.tau_init IS NOT NULL OR o.tau_end IS NOT NULL
                               THEN 'tau=' || coalesce(printf('%g', o.tau_init), '-') || '..'
                                    || coalesce(printf('%g', o.tau_end), '-') END)) AS config_label
FROM ok_runs AS o
LEFT JOIN full_cache_scores AS f USING (sweep_id, model, dataset, task, context_tokens, sample_id, protocol);

-- config_scores: one row per sweep x config x dataset x task x context length, the aggregation
-- summary.sql and compare_sweeps.sql share. The Wilson interval only where every score is in [0, 1].
CREATE OR REPLACE VIEW config_scores AS
WITH cells AS (
    SELECT sweep_id, method, budget, bits, tau_init, tau_end, protocol, dataset, task, context_tokens,
           config_label,
           count(*) AS runs,
           avg(score) AS score_mean,
           min(score) >= 0 AND max(score) <= 1 AS score_in_unit_range,
           avg(score_full) AS score_full_mean,
           avg(score - score_full) AS score_vs_full,
           avg(kl_mean) AS kl_mean,
           avg(top1_agree) AS top1_agree,
           avg(live_kv_bytes) AS live_kv_bytes,
           avg(kv_ratio_to_full) AS kv_ratio_to_full,
           avg(decode_tok_s) AS decode_tok_s,
           -- runs of one config that took different paths (two machines) list each, ' | ' between
           string_agg(DISTINCT kernel_paths, ' | ' ORDER BY kernel_paths) AS kernels,
           -- every run of the cell quantized nothing (NULL: a config that quantizes nothing by design)
           bool_and(quantizes_nothing) AS quantizes_nothing
    FROM run_scores
    GROUP BY sweep_id, method, budget, bits, tau_init, tau_end, protocol, config_label, dataset, task, context_tokens
)
SELECT *,
       CASE WHEN score_in_unit_range THEN wilson_low(score_mean, runs) END AS score_ci_low,
       CASE WHEN score_in_unit_range THEN wilson_high(score_mean, runs) END AS score_ci_high
FROM cells;
