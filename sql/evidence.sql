-- Evidence survival and correctness, per sweep x protocol x config x dataset x task x context:
-- is a wrong answer explained by lost evidence? Over ok runs whose sample records evidence
-- (needles, chain assignments, the pass key line).
-- evidence_kept_mean: fraction of evidence tokens held after the answer (mean over layers and KV
--   heads), averaged over runs; ..._when_correct / ..._when_wrong split it by score (1 = correct);
-- score_when_all_kept / score_when_some_lost: the score conditional on every evidence token held
--   in every layer and head (worst_layer_kept = 1) or not; runs_* count each side;
-- key_rel_err_mean / value_rel_err_mean: relative error of the held evidence keys/values
--   (quantizers), mean over layers at the final stage. Needs views.sql and run_scores.sql.
WITH per_run AS (
    SELECT sweep_id, run_id,
           min(kept_min) AS worst_layer_kept,
           avg(key_rel_err) AS key_rel_err,
           avg(value_rel_err) AS value_rel_err
    FROM evidence
    WHERE stage = 'final'
    GROUP BY ALL
)
SELECT r.sweep_id, r.protocol, r.dataset, r.task, r.context_tokens, r.config_label,
       count(*) AS runs,
       avg(r.score) AS score_mean,
       avg(r.evidence_kept) AS evidence_kept_mean,
       avg(r.evidence_kept) FILTER (WHERE r.score >= 1) AS evidence_kept_when_correct,
       avg(r.evidence_kept) FILTER (WHERE r.score < 1) AS evidence_kept_when_wrong,
       count(*) FILTER (WHERE e.worst_layer_kept >= 1) AS runs_all_kept,
       avg(r.score) FILTER (WHERE e.worst_layer_kept >= 1) AS score_when_all_kept,
       count(*) FILTER (WHERE e.worst_layer_kept < 1) AS runs_some_lost,
       avg(r.score) FILTER (WHERE e.worst_layer_kept < 1) AS score_when_some_lost,
       avg(e.key_rel_err) AS key_rel_err_mean,
       avg(e.value_rel_err) AS value_rel_err_mean
FROM run_scores AS r
JOIN per_run AS e USING (sweep_id, run_id)
WHERE r.evidence_kept IS NOT NULL
GROUP BY ALL
ORDER BY r.sweep_id, r.protocol, r.dataset, r.task, r.context_tokens, r.config_label;
