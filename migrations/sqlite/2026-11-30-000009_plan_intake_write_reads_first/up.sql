-- Postgres only: the write function reads a committed key row first.
-- SQLite reads it first in the service (a local read, no write lock).
SELECT 1;
