-- Logins are managed by the CLI only. The token is stored as its blake3 hash.
CREATE TABLE logins (
    name        TEXT      NOT NULL,
    token_hash  TEXT      NOT NULL,
    permissions TEXT      NOT NULL,
    created_at  TIMESTAMP NOT NULL,
    revoked_at  TIMESTAMP NULL,
    CONSTRAINT logins_pk PRIMARY KEY (name),
    CONSTRAINT logins_token_hash_uq UNIQUE (token_hash),
    CONSTRAINT logins_name_not_blank_ck CHECK (name ~ '\S')
);
