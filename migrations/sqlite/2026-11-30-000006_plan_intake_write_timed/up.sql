-- Postgres only: the write function with a lock timeout and SQLSTATE
-- markers. Here so that both backends carry the same migrations.
SELECT 1;
