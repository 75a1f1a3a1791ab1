-- Token rotation: the token a login had before its last rotation keeps
-- working until previous_token_expires_at (the grace period), or until the
-- login is revoked. The login's name, and so its keys and receipts, stay.
ALTER TABLE logins
    ADD COLUMN previous_token_hash       TEXT      NULL,
    ADD COLUMN previous_token_expires_at TIMESTAMP NULL;
CREATE UNIQUE INDEX logins_previous_token_hash_uq ON logins (previous_token_hash);
