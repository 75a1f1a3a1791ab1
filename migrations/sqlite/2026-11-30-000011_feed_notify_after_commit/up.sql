-- Postgres only: the write no longer notifies inside its transaction.
SELECT 1;
