-- Postgres only: the write function checks the login. SQLite checks it in
-- the service, on the connection that writes, before the write.
SELECT 1;
