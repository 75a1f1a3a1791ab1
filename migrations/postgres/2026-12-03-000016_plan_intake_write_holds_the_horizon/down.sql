-- Back to the write of 000015 and the horizon of 000008.
CREATE OR REPLACE FUNCTION plan_intake_write(
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

CREATE OR REPLACE FUNCTION plan_intake_feed_horizon(OUT horizon BIGINT, OUT lag_seconds DOUBLE PRECISION)
LANGUAGE plpgsql
AS $$
DECLARE
    next_xid BIGINT := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    oldest   BIGINT;
BEGIN
    SELECT MIN(CASE WHEN full_xid > next_xid THEN full_xid - 4294967296 ELSE full_xid END),
           COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - MIN(a.xact_start)), 0)
      INTO oldest, lag_seconds
      FROM (SELECT ((next_xid >> 32) << 32) | x.transactionid::text::bigint AS full_xid, x.pid
              FROM pg_locks r
              JOIN pg_locks x ON x.virtualtransaction = r.virtualtransaction
             WHERE r.locktype = 'relation' AND r.relation = 'plans'::regclass
               AND r.mode = 'RowExclusiveLock' AND r.granted
               AND x.locktype = 'transactionid' AND x.mode = 'ExclusiveLock' AND x.granted) w
      LEFT JOIN pg_stat_activity a ON a.pid = w.pid;
    horizon := LEAST(next_xid, COALESCE(oldest, next_xid)) + plan_intake_feed_base(false);
END
$$;
