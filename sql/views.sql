-- Views every report reads. Set the results root first:
--   SET VARIABLE kv_results = 'results';   (a path or URL)
-- sweep_id and method come from the hive directories (read as text, never guessed numeric).
-- `kvcompress report` also sets kv_runs_files / kv_steps_files / kv_evidence_files to the files that read as
-- Parquet, so one corrupt file is skipped with a warning instead of failing every report.
-- Columns added to `runs` later read as NULL in results written before them (the UNION BY NAME with
-- no rows below adds them where no file has them yet).
CREATE OR REPLACE VIEW runs AS
SELECT *
FROM read_parquet(coalesce(getvariable('kv_runs_files'), [getvariable('kv_results') || '/runs/**/*.parquet']),
                  hive_partitioning = true, union_by_name = true,
                  hive_types = {'sweep_id': VARCHAR, 'method': VARCHAR})
UNION ALL BY NAME
SELECT CAST(NULL AS BIGINT) AS quantized_tokens WHERE false;

CREATE OR REPLACE VIEW steps AS
SELECT *
FROM read_parquet(coalesce(getvariable('kv_steps_files'), [getvariable('kv_results') || '/steps/**/*.parquet']),
                  hive_partitioning = true, union_by_name = true,
                  hive_types = {'sweep_id': VARCHAR, 'method': VARCHAR});

-- evidence: per run, layer and stage, how much of the sample's evidence the cache held
CREATE OR REPLACE VIEW evidence AS
SELECT *
FROM read_parquet(coalesce(getvariable('kv_evidence_files'), [getvariable('kv_results') || '/evidence/**/*.parquet']),
                  hive_partitioning = true, union_by_name = true,
                  hive_types = {'sweep_id': VARCHAR, 'method': VARCHAR});
