-- Quality vs memory Pareto front: per sweep x dataset x context length, every config with its mean
-- score (over all tasks and samples of the dataset) and mean resident KV bytes. A config is on the
-- front when no other config of the same cell dominates it: another config dominates when it scores
-- at least as well with at most as many live bytes, and is strictly better on one of the two.
-- dominated_by counts the configs that dominate it (0 on the front). Ties (same score, same bytes)
-- dominate neither way, so both stay on the front. Configs of both protocols share one front
-- (protocol: a function of config_label, there to filter by). A config whose quantizer held no token
-- as codes in any run of the cell (quantizes_nothing: every kept token inside its full-precision
-- window, e.g. SnapKV 25% + KIVI with a 128-token residual on a 512-token prompt) is the unquantized
-- config's point in more bytes, not a point of its own: it is listed, labelled, neither on the front
-- nor dominating any other. Needs views.sql and run_scores.sql.
WITH config_points AS MATERIALIZED (  -- once: point_id must be the same in every reference
    SELECT sweep_id, dataset, context_tokens, method, budget, bits, tau_init, tau_end,
           protocol, config_label,
           count(*) AS runs,
           avg(score) AS score_mean,
           min(score) >= 0 AND max(score) <= 1 AS score_in_unit_range,
           avg(score_full) AS score_full_mean,
           avg(live_kv_bytes) AS live_kv_bytes,
           avg(kv_ratio_to_full) AS kv_ratio_to_full,
           coalesce(bool_and(quantizes_nothing), false) AS quantizes_nothing,
           row_number() OVER () AS point_id  -- a config's exact identity within this query
    FROM run_scores
    GROUP BY sweep_id, dataset, context_tokens, method, budget, bits, tau_init, tau_end, protocol, config_label
),
dominance AS (
    SELECT p.point_id, count(q.point_id) AS dominated_by
    FROM config_points AS p
    LEFT JOIN config_points AS q
        ON q.sweep_id = p.sweep_id AND q.dataset = p.dataset AND q.context_tokens = p.context_tokens
       AND q.score_mean >= p.score_mean AND q.live_kv_bytes <= p.live_kv_bytes
       AND (q.score_mean > p.score_mean OR q.live_kv_bytes < p.live_kv_bytes)
       AND NOT q.quantizes_nothing
    GROUP BY p.point_id
)
SELECT c.sweep_id, c.dataset, c.context_tokens,
       c.method, c.budget, c.bits, c.tau_init, c.tau_end,
       d.dominated_by = 0 AND NOT c.quantizes_nothing AS on_front, d.dominated_by,
       c.runs, c.score_mean,
       CASE WHEN c.score_in_unit_range THEN wilson_low(c.score_mean, c.runs) END AS score_ci_low,
       CASE WHEN c.score_in_unit_range THEN wilson_high(c.score_mean, c.runs) END AS score_ci_high,
       c.score_full_mean,
       CAST(round(c.live_kv_bytes) AS BIGINT) AS live_kv_bytes,
       c.kv_ratio_to_full, c.protocol, c.config_label,
       CASE WHEN c.quantizes_nothing THEN 'quantizes nothing' END AS note
FROM config_points AS c
JOIN dominance AS d USING (point_id)
ORDER BY c.sweep_id, c.dataset, c.context_tokens, c.live_kv_bytes, c.score_mean DESC, c.config_label;
