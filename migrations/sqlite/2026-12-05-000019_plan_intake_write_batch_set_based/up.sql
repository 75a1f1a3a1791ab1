-- Postgres only: a batch's new plans written set-based (SQLite writes through its group commit).
SELECT 1;
