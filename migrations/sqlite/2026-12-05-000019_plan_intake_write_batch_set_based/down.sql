-- Postgres only.
SELECT 1;
