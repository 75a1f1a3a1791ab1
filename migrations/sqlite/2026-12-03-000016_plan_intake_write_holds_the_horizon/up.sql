-- Postgres only: the write holds the feed's horizon (SQLite admits one writer at a time).
SELECT 1;
