-- Signed receipts and the append-only log of them (the Postgres migration
-- of the same name says why each table is there). INTEGER primary keys are
-- the rowid (no second index); uniques are named indexes, as in 000001.
ALTER TABLE plans ADD COLUMN receipt_signature TEXT;

CREATE TABLE receipt_log (
    leaf_index INTEGER NOT NULL CONSTRAINT receipt_log_pk PRIMARY KEY,
    receipt_id TEXT    NOT NULL,
    leaf_hash  BLOB    NOT NULL
);
CREATE UNIQUE INDEX receipt_log_receipt_id_uq ON receipt_log (receipt_id);
CREATE TABLE receipt_log_hashes (
    hash_index INTEGER NOT NULL CONSTRAINT receipt_log_hashes_pk PRIMARY KEY,
    hash       BLOB    NOT NULL
);
CREATE TABLE receipt_log_checkpoints (
    tree_size INTEGER   NOT NULL CONSTRAINT receipt_log_checkpoints_pk PRIMARY KEY,
    root_hash BLOB      NOT NULL,
    note      TEXT      NOT NULL,
    signed_at TIMESTAMP NOT NULL
);
CREATE TABLE receipt_log_state (
    id             INTEGER NOT NULL CONSTRAINT receipt_log_state_pk PRIMARY KEY
                           CONSTRAINT receipt_log_state_one_row_ck CHECK (id = 1),
    tree_size      BIGINT  NOT NULL,
    after_feed_xid BIGINT  NOT NULL,
    after_plan_id  BIGINT  NOT NULL
);
INSERT INTO receipt_log_state (id, tree_size, after_feed_xid, after_plan_id) VALUES (1, 0, 0, 0);
CREATE TABLE signing_keys (
    key_id        TEXT      NOT NULL,
    verifier_key  TEXT      NOT NULL,
    first_used_at TIMESTAMP NOT NULL,
    last_used_at  TIMESTAMP NOT NULL,
    CONSTRAINT signing_keys_pk PRIMARY KEY (key_id)
) WITHOUT ROWID;
