-- Paired rows: every ok run with the full cache's score and the baseline config's score on the
-- SAME sample (same sweep, dataset, task, context length, sample id and protocol). The baseline is
-- a config_label: SET VARIABLE baseline = 'h2o budget=0.5'; (unset: no baseline column values).
-- `kvcompress report` turns these rows into the `paired` report: per config the mean paired
-- difference with a paired bootstrap 95% CI and, for 0/1 scores, the exact McNemar p-value
-- (kvcompress/stats.py). Needs views.sql and run_scores.sql.
WITH baseline_scores AS (
    SELECT sweep_id, model, dataset, task, context_tokens, sample_id, protocol, avg(score) AS score_baseline
    FROM run_scores
    WHERE config_label = getvariable('baseline')
    GROUP BY ALL
)
SELECT r.sweep_id, r.protocol, r.dataset, r.task, r.context_tokens, r.config_label, r.method, r.sample_id,
       r.score, r.score_full, b.score_baseline
FROM run_scores AS r
LEFT JOIN baseline_scores AS b USING (sweep_id, model, dataset, task, context_tokens, sample_id, protocol)
ORDER BY r.sweep_id, r.protocol, r.dataset, r.task, r.context_tokens, r.config_label, r.sample_id;
