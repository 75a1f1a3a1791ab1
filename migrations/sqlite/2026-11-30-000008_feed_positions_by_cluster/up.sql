-- Postgres only: feed positions by cluster. SQLite orders the feed by id,
-- which AUTOINCREMENT never reuses, so a copied file keeps it.
SELECT 1;
