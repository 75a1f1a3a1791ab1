-- Signed receipts and the append-only log of them.
--
-- A receipt's Ed25519 signature is made by the service before the write
-- (over the receipt's RFC 8785 form) and kept with its plan, so a replay
-- answers the signature the plan was first answered with, whatever key
-- signs today. NULL: signed by no key (a service started without one).
ALTER TABLE plans ADD COLUMN receipt_signature TEXT;

-- The log: receipts as leaves of an RFC 6962 Merkle tree, in feed order.
-- `receipt_log_hashes` keeps every stored hash of the tree (the numbering
-- of Go's tlog: each leaf's hash and each completed subtree's), so any
-- proof is read, never recomputed. Rows are only ever added; the service's
-- role may not update or delete them (`migrate grants`).
CREATE TABLE receipt_log (
    leaf_index BIGINT NOT NULL CONSTRAINT receipt_log_pk PRIMARY KEY,
    receipt_id TEXT   NOT NULL CONSTRAINT receipt_log_receipt_id_uq UNIQUE,
    leaf_hash  BYTEA  NOT NULL
);
CREATE TABLE receipt_log_hashes (
    hash_index BIGINT NOT NULL CONSTRAINT receipt_log_hashes_pk PRIMARY KEY,
    hash       BYTEA  NOT NULL
);
-- Every checkpoint the service signed: a C2SP tlog-checkpoint signed note.
CREATE TABLE receipt_log_checkpoints (
    tree_size BIGINT    NOT NULL CONSTRAINT receipt_log_checkpoints_pk PRIMARY KEY,
    root_hash BYTEA     NOT NULL,
    note      TEXT      NOT NULL,
    signed_at TIMESTAMP NOT NULL
);
-- The one row appenders take turns on (FOR UPDATE): how many leaves the
-- tree has and the feed position of the last one.
CREATE TABLE receipt_log_state (
    id             BIGINT  NOT NULL CONSTRAINT receipt_log_state_pk PRIMARY KEY
                           CONSTRAINT receipt_log_state_one_row_ck CHECK (id = 1),
    tree_size      BIGINT  NOT NULL,
    after_feed_xid BIGINT  NOT NULL,
    after_plan_id  BIGINT  NOT NULL
);
INSERT INTO receipt_log_state (id, tree_size, after_feed_xid, after_plan_id) VALUES (1, 0, 0, 0);
-- The public keys that have signed receipts or checkpoints, and when.
CREATE TABLE signing_keys (
    key_id        TEXT      NOT NULL CONSTRAINT signing_keys_pk PRIMARY KEY,
    verifier_key  TEXT      NOT NULL,
    first_used_at TIMESTAMP NOT NULL,
    last_used_at  TIMESTAMP NOT NULL
);

-- The write of migration 000012, which also keeps the receipt's signature
-- and answers it with the receipt's columns.
DROP FUNCTION plan_intake_write(TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TEXT, TIMESTAMP, TEXT, INTEGER, TEXT);
CREATE FUNCTION plan_intake_write(
    p_receipt_id      TEXT,
    p_maker           TEXT,
    p_run_id          TEXT,
    p_content_hash    TEXT,
    p_request_hash    TEXT,
    p_content         TEXT,
    p_approved_inputs TEXT,
    p_permissions     TEXT,
    p_received_at     TIMESTAMP,
    p_idempotency_key TEXT,
    p_lock_timeout_ms INTEGER,
    p_token_hash      TEXT,
    p_receipt_signature TEXT
) RETURNS TABLE (
    outcome          TEXT,
    key_request_hash TEXT,
    id               BIGINT,
    receipt_id       TEXT,
    maker            TEXT,
    run_id           TEXT,
    content_hash     TEXT,
    request_hash     TEXT,
    approved_inputs  TEXT,
    permissions      TEXT,
    received_at      TIMESTAMP,
    receipt_signature TEXT
)
LANGUAGE plpgsql
AS $$
DECLARE
    new_plan_id  BIGINT;
    kept_plan_id BIGINT;
    conflicted   BOOLEAN := false;
    e_state      TEXT;
    e_message    TEXT;
    e_detail     TEXT;
    e_constraint TEXT;
    e_table      TEXT;
    e_column     TEXT;
BEGIN
    PERFORM set_config('lock_timeout', greatest(p_lock_timeout_ms, 1)::text, true);
    BEGIN
        PERFORM 1
           FROM logins l
          WHERE l.name = p_maker
            AND l.revoked_at IS NULL
            AND (l.token_hash = p_token_hash
                 OR (l.previous_token_hash = p_token_hash
                     AND l.previous_token_expires_at > p_received_at))
            AND l.permissions::jsonb ? 'plans:submit';
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'unauthorized', p_request_hash, 0::BIGINT, p_receipt_id, p_maker,
                                p_run_id, p_content_hash, p_request_hash, p_approved_inputs,
                                p_permissions, p_received_at, NULL::TEXT;
            RETURN;
        END IF;
        RETURN QUERY
            SELECT 'key_held', k.request_hash, p.id, p.receipt_id, p.maker, p.run_id,
                   p.content_hash, p.request_hash, p.approved_inputs, p.permissions,
                   p.received_at, p.receipt_signature
              FROM intake_keys k JOIN plans p ON p.id = k.plan_id
             WHERE k.maker = p_maker AND k.idempotency_key = p_idempotency_key;
        IF FOUND THEN
            RETURN;
        END IF;
        BEGIN
            INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash, content,
                               approved_inputs, permissions, received_at, receipt_signature)
            VALUES (p_receipt_id, p_maker, p_run_id, p_content_hash, p_request_hash, p_content,
                    p_approved_inputs, p_permissions, p_received_at, p_receipt_signature)
            RETURNING plans.id INTO new_plan_id;
            INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at)
            VALUES (p_maker, p_idempotency_key, p_request_hash, new_plan_id, p_received_at);
        EXCEPTION WHEN unique_violation THEN
            -- Both rows are rolled back; keep what the violation said, in
            -- case neither row that could have won is found.
            conflicted := true;
            GET STACKED DIAGNOSTICS
                e_state      = RETURNED_SQLSTATE,
                e_message    = MESSAGE_TEXT,
                e_detail     = PG_EXCEPTION_DETAIL,
                e_constraint = CONSTRAINT_NAME,
                e_table      = TABLE_NAME,
                e_column     = COLUMN_NAME;
        END;
        IF conflicted THEN
            -- A new statement: its snapshot sees the winner's commit.
            RETURN QUERY
                SELECT 'key_held', k.request_hash, p.id, p.receipt_id, p.maker, p.run_id,
                       p.content_hash, p.request_hash, p.approved_inputs, p.permissions,
                       p.received_at, p.receipt_signature
                  FROM intake_keys k JOIN plans p ON p.id = k.plan_id
                 WHERE k.maker = p_maker AND k.idempotency_key = p_idempotency_key;
            IF FOUND THEN
                RETURN;
            END IF;
            SELECT p.id INTO kept_plan_id
              FROM plans p
             WHERE p.maker = p_maker AND p.run_id = p_run_id AND p.content_hash = p_content_hash;
            IF kept_plan_id IS NULL THEN
                RAISE EXCEPTION USING
                    ERRCODE = e_state, MESSAGE = e_message, DETAIL = e_detail,
                    CONSTRAINT = e_constraint, TABLE = e_table, COLUMN = e_column;
            END IF;
            BEGIN
                INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at)
                VALUES (p_maker, p_idempotency_key, p_request_hash, kept_plan_id, p_received_at);
            EXCEPTION WHEN unique_violation THEN
                -- A concurrent request took this key first: its row decides.
                RETURN QUERY
                    SELECT 'key_held', k.request_hash, p.id, p.receipt_id, p.maker, p.run_id,
                           p.content_hash, p.request_hash, p.approved_inputs, p.permissions,
                           p.received_at, p.receipt_signature
                      FROM intake_keys k JOIN plans p ON p.id = k.plan_id
                     WHERE k.maker = p_maker AND k.idempotency_key = p_idempotency_key;
                IF FOUND THEN
                    RETURN;
                END IF;
                RAISE;
            END;
            RETURN QUERY
                SELECT 'already_received', p_request_hash, p.id, p.receipt_id, p.maker, p.run_id,
                       p.content_hash, p.request_hash, p.approved_inputs, p.permissions,
                       p.received_at, p.receipt_signature
                  FROM plans p
                 WHERE p.id = kept_plan_id;
            RETURN;
        END IF;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        GET STACKED DIAGNOSTICS
            e_state      = RETURNED_SQLSTATE,
            e_message    = MESSAGE_TEXT,
            e_detail     = PG_EXCEPTION_DETAIL,
            e_constraint = CONSTRAINT_NAME,
            e_table      = TABLE_NAME,
            e_column     = COLUMN_NAME;
        RAISE EXCEPTION USING
            ERRCODE    = e_state,
            MESSAGE    = e_message,
            DETAIL     = e_detail,
            HINT       = 'plan-intake-sqlstate:' || e_state,
            CONSTRAINT = e_constraint,
            TABLE      = e_table,
            COLUMN     = e_column;
    END;
    RETURN QUERY SELECT 'created', p_request_hash, new_plan_id, p_receipt_id, p_maker, p_run_id,
                        p_content_hash, p_request_hash, p_approved_inputs, p_permissions,
                        p_received_at, p_receipt_signature;
END
$$;
