-- Views every report reads. Set the results root first:
--   SET VARIABLE kv_results = 'results';   (a path or URL)
-- sweep_id and method come from the hive directories (read as text, never guessed numeric).
CREATE OR REPLACE VIEW runs AS
SELECT *
FROM read_parquet(getvariable('kv_results') || '/runs/**/*.parquet',
                  hive_partitioning = true, union_by_name = true,
                  hive_types = {'sweep_id': VARCHAR, 'method': VARCHAR});

CREATE OR REPLACE VIEW steps AS
SELECT *
FROM read_parquet(getvariable('kv_results') || '/steps/**/*.parquet',
                  hive_partitioning = true, union_by_name = true,
                  hive_types = {'sweep_id': VARCHAR, 'method': VARCHAR});
