-- Postgres only: the write function records the key of a request it answers
-- `already_received`. SQLite does the same inside its group-commit batch.
SELECT 1;
