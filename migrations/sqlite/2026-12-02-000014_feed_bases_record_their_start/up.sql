-- Postgres only: where each timeline's feed positions start. SQLite has
-- no timelines.
SELECT 1;
