-- Postgres only: a feed base recorded by a writer lands past every stored position (SQLite has no feed bases).
SELECT 1;
