-- Postgres only: the feed's horizon reads writers newer than its snapshot right (SQLite has no horizon).
SELECT 1;
