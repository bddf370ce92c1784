-- Score by where the evidence sits and how long the context is (the needle test's depth x length
-- grid), per sweep x protocol x config x dataset x task x context length x depth tenth.
-- depth_low..depth_high: the tenth of the prompt before the question that holds the first evidence
--   token (runs.evidence_depth, kvcompress/evidence.py; 1.0 falls in the last tenth). Runs written
--   before that column existed fall back to the depth the sweep pinned (dataset_params.depth in
--   `config`); runs with neither (no evidence, e.g. lm; random depths in old results) are left out.
-- score_mean with its 95% Wilson interval (see run_scores.sql), the full cache's mean score on the
-- same samples (score_full_mean) and the mean paired difference score_vs_full.
-- Needs views.sql and run_scores.sql.
WITH scored AS (
    -- BY NAME with an empty select: results written before evidence_depth existed read it as NULL
    SELECT * FROM run_scores
    UNION ALL BY NAME
    SELECT CAST(NULL AS DOUBLE) AS evidence_depth WHERE false
),
placed AS (
    SELECT *, coalesce(evidence_depth,
                       TRY_CAST(json_extract_string(config, '$.dataset_params.depth') AS DOUBLE)) AS depth
    FROM scored
),
binned AS (
    SELECT *, least(floor(10 * depth), 9) AS depth_tenth
    FROM placed
    WHERE depth IS NOT NULL  -- here, not after: least() skips NULLs, so least(NULL, 9) is 9
),
cells AS (
    SELECT sweep_id, protocol, dataset, task, method, budget, bits, tau_init, tau_end, config_label,
           context_tokens, depth_tenth,
           count(*) AS runs,
           avg(score) AS score_mean,
           min(score) >= 0 AND max(score) <= 1 AS score_in_unit_range,
           avg(score_full) AS score_full_mean,
           avg(score - score_full) AS score_vs_full
    FROM binned
    GROUP BY ALL
)
SELECT sweep_id, protocol, dataset, task, method, budget, bits, tau_init, tau_end, context_tokens,
       depth_tenth / 10 AS depth_low, (depth_tenth + 1) / 10 AS depth_high,
       runs, score_mean,
       CASE WHEN score_in_unit_range THEN wilson_low(score_mean, runs) END AS score_ci_low,
       CASE WHEN score_in_unit_range THEN wilson_high(score_mean, runs) END AS score_ci_high,
       score_full_mean, score_vs_full, config_label
FROM cells
ORDER BY sweep_id, protocol, dataset, task, method, budget NULLS FIRST, bits NULLS FIRST,
         tau_init NULLS FIRST, tau_end NULLS FIRST, config_label, context_tokens, depth_low;
