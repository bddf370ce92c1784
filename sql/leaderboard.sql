-- Leaderboard: per sweep x protocol, every config ranked by its task-averaged score, with its
-- compression ratio, n and the paired difference from the full cache. Over config_scores
-- (run_scores.sql), so a config's score is the one every report shows.
-- tasks: the cells (dataset x task x context length) averaged, each with equal weight; n: runs in all.
-- score_mean: the mean of the cells' mean scores. score_ci_low..score_ci_high: the cells' 95% Wilson
--   intervals combined as for a mean of independent estimates, each side apart (Wilson's interval is
--   not symmetric): score_mean - sqrt(sum of (score - low)^2) / tasks .. score_mean + sqrt(sum of
--   (high - score)^2) / tasks, within [0, 1]. One cell: exactly its Wilson interval; it always holds
--   score_mean. NULL unless every cell's scores lie in [0, 1].
-- compression_ratio: full cache bytes / resident bytes (1 / the mean kv_ratio_to_full over the cells).
-- diff_vs_full: the mean of the cells' paired differences (score - the full cache's on the same
--   samples). `kvcompress report` adds its paired bootstrap CI and verdict over the same runs
--   (kvcompress_reports.db.leaderboard_statistics, as for the paired report).
-- rank: 1 = best score in its sweep and protocol; ties broken by the smaller KV.
WITH configs AS (
    SELECT sweep_id, protocol, config_label, method, budget, bits, tau_init, tau_end,
           count(*) AS tasks,
           sum(runs) AS n,
           avg(score_mean) AS score_mean,
           -- count(score_ci_low) < count(*): a cell without an interval leaves the config without one
           CASE WHEN count(score_ci_low) = count(*)
                THEN sqrt(sum((score_mean - score_ci_low) ^ 2)) / count(*) END AS ci_below,
           CASE WHEN count(score_ci_high) = count(*)
                THEN sqrt(sum((score_ci_high - score_mean) ^ 2)) / count(*) END AS ci_above,
           1 / nullif(avg(kv_ratio_to_full), 0) AS compression_ratio,
           avg(kv_ratio_to_full) AS kv_ratio_to_full,
           avg(score_vs_full) AS diff_vs_full
    FROM config_scores
    GROUP BY sweep_id, protocol, config_label, method, budget, bits, tau_init, tau_end
)
SELECT sweep_id, protocol,
       row_number() OVER (PARTITION BY sweep_id, protocol
                          ORDER BY score_mean DESC NULLS LAST, kv_ratio_to_full ASC NULLS LAST, config_label) AS rank,
       config_label, method, budget, bits, tau_init, tau_end, compression_ratio, kv_ratio_to_full, tasks, n, score_mean,
       greatest(score_mean - ci_below, 0.0) AS score_ci_low, least(score_mean + ci_above, 1.0) AS score_ci_high,
       diff_vs_full
FROM configs
ORDER BY sweep_id, protocol, rank;
