-- Logins are managed by the CLI only. The token is stored as its blake3 hash.
-- SQLite keeps no name for a UNIQUE table constraint, so uniques are named indexes.
CREATE TABLE logins (
    name        TEXT      NOT NULL,
    token_hash  TEXT      NOT NULL,
    permissions TEXT      NOT NULL,
    created_at  TIMESTAMP NOT NULL,
    revoked_at  TIMESTAMP NULL,
    CONSTRAINT logins_pk PRIMARY KEY (name),
    CONSTRAINT logins_name_not_blank_ck CHECK (trim(name, ' ' || char(9, 10, 13)) <> '')
) WITHOUT ROWID;
CREATE UNIQUE INDEX logins_token_hash_uq ON logins (token_hash);
