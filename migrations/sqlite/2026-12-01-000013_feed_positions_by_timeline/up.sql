-- Postgres only: feed bases keyed by timeline. SQLite orders its feed by
-- `id`, which a promoted copy of the file keeps.
SELECT 1;
