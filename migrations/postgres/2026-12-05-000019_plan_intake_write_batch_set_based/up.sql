-- A batch's new plans written set-based (issue 54): one INSERT for their
-- plans and one for their key rows, each `ON CONFLICT DO NOTHING`, where
-- a batch called plan_intake_write once a plan (two subtransactions and
-- a dozen statements each). What did not land that way (a refused login,
-- a key already held, a plan or key met by a conflict, a repeat inside the
-- batch) goes through plan_intake_write as before, one by one, in the
-- batch's order, after the set-based part, so every rule of the single
-- write still decides it. The guarantees, as in ARCHITECTURE.md:
-- - both rows or neither: the two INSERTs run in one subtransaction, and
--   if any key row meets a conflict the whole of it is rolled back (its
--   plans then go one by one);
-- - a key bound by its first answer: a key row is only ever inserted, a
--   held one answered as held, a conflicting one decided one by one;
-- - the feed's horizon: `plans` is locked (ROW EXCLUSIVE) before the first
--   INSERT gives the transaction its id, outside the subtransaction, so a
--   rollback of it keeps the lock (000016);
-- - budgets: lock_timeout is the smallest budget left in the batch; one
--   by one, each call sets its own;
-- - every error leaves with its SQLSTATE in the hint, as
--   plan_intake_write's do.
CREATE FUNCTION plan_intake_write_batch(
    p_receipt_id        TEXT[],
    p_maker             TEXT[],
    p_run_id            TEXT[],
    p_content_hash      TEXT[],
    p_request_hash      TEXT[],
    p_content           TEXT[],
    p_approved_inputs   TEXT[],
    p_permissions       TEXT[],
    p_received_at       TIMESTAMP[],
    p_idempotency_key   TEXT[],
    p_lock_timeout_ms   INTEGER[],
    p_token_hash        TEXT[],
    p_receipt_signature TEXT[]
) RETURNS TABLE (
    ord              BIGINT,
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
    answered  BIGINT[] := '{}';
    keyed     BIGINT[] := '{}';
    inserted  INTEGER;
    with_keys INTEGER;
    r         RECORD;
    i         INTEGER;
    e_state      TEXT;
    e_message    TEXT;
    e_detail     TEXT;
    e_constraint TEXT;
    e_table      TEXT;
    e_column     TEXT;
BEGIN
    PERFORM set_config('lock_timeout', greatest(
        (SELECT min(t) FROM unnest(p_lock_timeout_ms) t)
          - (EXTRACT(EPOCH FROM clock_timestamp() - statement_timestamp()) * 1000)::INTEGER,
        1)::text, true);
    BEGIN
        -- Refused: the login that the token names, as plan_intake_write
        -- checks it.
        FOR r IN
            SELECT b.* FROM unnest(p_receipt_id, p_maker, p_run_id, p_content_hash, p_request_hash,
                                   p_approved_inputs, p_permissions, p_received_at, p_token_hash)
                            WITH ORDINALITY AS b(receipt_id, maker, run_id, content_hash, request_hash,
                                                 approved_inputs, permissions, received_at, token_hash, ord)
             WHERE NOT EXISTS (
                   SELECT 1 FROM logins l
                    WHERE l.name = b.maker
                      AND l.revoked_at IS NULL
                      AND (l.token_hash = b.token_hash
                           OR (l.previous_token_hash = b.token_hash
                               AND l.previous_token_expires_at > b.received_at))
                      AND l.permissions::jsonb ? 'plans:submit')
        LOOP
            ord := r.ord; outcome := 'unauthorized'; key_request_hash := r.request_hash;
            id := 0; receipt_id := r.receipt_id; maker := r.maker; run_id := r.run_id;
            content_hash := r.content_hash; request_hash := r.request_hash;
            approved_inputs := r.approved_inputs; permissions := r.permissions;
            received_at := r.received_at; receipt_signature := NULL;
            RETURN NEXT;
            answered := answered || r.ord;
        END LOOP;
        -- Held: the key's row decides.
        FOR r IN
            SELECT b.ord AS b_ord, k.request_hash AS k_request_hash, p.*
              FROM unnest(p_maker, p_idempotency_key) WITH ORDINALITY AS b(maker, idempotency_key, ord)
              JOIN intake_keys k ON k.maker = b.maker AND k.idempotency_key = b.idempotency_key
              JOIN plans p ON p.id = k.plan_id
             WHERE NOT (b.ord = ANY (answered))
        LOOP
            ord := r.b_ord; outcome := 'key_held'; key_request_hash := r.k_request_hash;
            id := r.id; receipt_id := r.receipt_id; maker := r.maker; run_id := r.run_id;
            content_hash := r.content_hash; request_hash := r.request_hash;
            approved_inputs := r.approved_inputs; permissions := r.permissions;
            received_at := r.received_at; receipt_signature := r.receipt_signature;
            RETURN NEXT;
            answered := answered || r.b_ord;
        END LOOP;
        IF cardinality(answered) < cardinality(p_receipt_id) THEN
            -- The horizon, before the first INSERT gives this transaction
            -- its id, in this block (whose locks pass to the transaction),
            -- not in the one below (whose rollback would release it).
            LOCK TABLE plans IN ROW EXCLUSIVE MODE;
            BEGIN
                -- The first of each key, of each plan and of each receipt
                -- id in the batch (so each new plan meets its own key row
                -- alone); a repeat goes one by one after it, as if sent
                -- later.
                WITH b AS (
                    SELECT * FROM unnest(p_receipt_id, p_maker, p_run_id, p_content_hash,
                                         p_request_hash, p_content, p_approved_inputs,
                                         p_permissions, p_received_at, p_idempotency_key,
                                         p_receipt_signature)
                                  WITH ORDINALITY AS b(receipt_id, maker, run_id, content_hash,
                                                       request_hash, content, approved_inputs,
                                                       permissions, received_at, idempotency_key,
                                                       receipt_signature, ord)
                     WHERE NOT (b.ord = ANY (answered))
                ), fresh AS (
                    SELECT b.* FROM b
                     WHERE NOT EXISTS (
                           SELECT 1 FROM b e
                            WHERE e.ord < b.ord
                              AND (e.receipt_id = b.receipt_id
                                   OR (e.maker = b.maker
                                       AND (e.idempotency_key = b.idempotency_key
                                            OR (e.run_id = b.run_id
                                                AND e.content_hash = b.content_hash)))))
                ), new_plans AS (
                    INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash,
                                       content, approved_inputs, permissions, received_at,
                                       receipt_signature)
                    SELECT f.receipt_id, f.maker, f.run_id, f.content_hash, f.request_hash,
                           f.content, f.approved_inputs, f.permissions, f.received_at,
                           f.receipt_signature
                      FROM fresh f ORDER BY f.ord
                    ON CONFLICT DO NOTHING
                    RETURNING plans.id, plans.receipt_id
                ), new_keys AS (
                    INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at)
                    SELECT f.maker, f.idempotency_key, f.request_hash, n.id, f.received_at
                      FROM fresh f JOIN new_plans n ON n.receipt_id = f.receipt_id
                     ORDER BY f.ord
                    ON CONFLICT DO NOTHING
                    RETURNING intake_keys.plan_id
                )
                SELECT (SELECT count(*) FROM new_plans), count(*), coalesce(array_agg(k.plan_id), '{}')
                  INTO inserted, with_keys, keyed
                  FROM new_keys k;
                IF with_keys <> inserted THEN
                    -- A key row met a conflict: undo both INSERTs, so no
                    -- plan stays without its key; they go one by one.
                    RAISE EXCEPTION 'a key row met a conflict' USING ERRCODE = 'PIK01';
                END IF;
            EXCEPTION WHEN SQLSTATE 'PIK01' THEN
                keyed := '{}';
            END;
            FOR r IN
                SELECT b.ord AS b_ord, p.*
                  FROM unnest(p_receipt_id) WITH ORDINALITY AS b(receipt_id, ord)
                  JOIN plans p ON p.receipt_id = b.receipt_id
                 WHERE p.id = ANY (keyed)
            LOOP
                ord := r.b_ord; outcome := 'created'; key_request_hash := r.request_hash;
                id := r.id; receipt_id := r.receipt_id; maker := r.maker; run_id := r.run_id;
                content_hash := r.content_hash; request_hash := r.request_hash;
                approved_inputs := r.approved_inputs; permissions := r.permissions;
                received_at := r.received_at; receipt_signature := r.receipt_signature;
                RETURN NEXT;
                answered := answered || r.b_ord;
            END LOOP;
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
    -- The rest, each as alone, in the batch's order (plan_intake_write
    -- marks its own errors).
    FOR i IN 1 .. cardinality(p_receipt_id) LOOP
        CONTINUE WHEN i = ANY (answered);
        FOR r IN
            SELECT * FROM plan_intake_write(p_receipt_id[i], p_maker[i], p_run_id[i],
                                            p_content_hash[i], p_request_hash[i], p_content[i],
                                            p_approved_inputs[i], p_permissions[i],
                                            p_received_at[i], p_idempotency_key[i],
                                            p_lock_timeout_ms[i], p_token_hash[i],
                                            p_receipt_signature[i]) w
        LOOP
            ord := i; outcome := r.outcome; key_request_hash := r.key_request_hash;
            id := r.id; receipt_id := r.receipt_id; maker := r.maker; run_id := r.run_id;
            content_hash := r.content_hash; request_hash := r.request_hash;
            approved_inputs := r.approved_inputs; permissions := r.permissions;
            received_at := r.received_at; receipt_signature := r.receipt_signature;
            RETURN NEXT;
        END LOOP;
    END LOOP;
END
$$;
