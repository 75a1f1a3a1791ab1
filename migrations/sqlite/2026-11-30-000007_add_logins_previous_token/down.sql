DROP INDEX logins_previous_token_hash_uq;
ALTER TABLE logins DROP COLUMN previous_token_expires_at;
ALTER TABLE logins DROP COLUMN previous_token_hash;
