-- Postgres only: the one-statement write function. SQLite writes both rows
-- in a BEGIN IMMEDIATE transaction and needs nothing here; this migration
-- exists so that both backends carry the same migrations under the same names.
SELECT 1;
