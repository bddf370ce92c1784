-- The speed sweep's view (docs/speed.md), apart from views.sql so that a results root without speed
-- measurements reads as before. Set the results root first:
--   SET VARIABLE kv_results = 'results';
-- `kvcompress report` sets kv_speed_files to the files that read as Parquet (and an empty view when
-- there are none).
CREATE OR REPLACE VIEW speed AS
SELECT *
FROM read_parquet(coalesce(getvariable('kv_speed_files'), [getvariable('kv_results') || '/speed/**/*.parquet']),
                  hive_partitioning = true, union_by_name = true,
                  hive_types = {'sweep_id': VARCHAR, 'method': VARCHAR});
