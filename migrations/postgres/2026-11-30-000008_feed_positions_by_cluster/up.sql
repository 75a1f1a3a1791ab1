-- Feed positions that survive a dump restored into another cluster (or a
-- logical move): a position is the writing transaction's id plus a base
-- chosen once per cluster, the first time the cluster writes a plan, so that
-- its positions start past every position already stored. In the cluster
-- that ran this migration the base is 0: positions do not change.
CREATE TABLE feed_bases (
    system_identifier BIGINT NOT NULL,
    base              BIGINT NOT NULL,
    CONSTRAINT feed_bases_pk PRIMARY KEY (system_identifier)
);

-- This cluster's base. With p_record, the first call records it (a
-- concurrent first call waits on the primary key, then uses the one
-- recorded); without, it only computes what would be recorded, which is
-- never more than what a later first writer records.
CREATE FUNCTION plan_intake_feed_base(p_record BOOLEAN) RETURNS BIGINT
LANGUAGE plpgsql
AS $$
DECLARE
    cluster BIGINT := NULLIF(current_setting('plan_intake.system_identifier', true), '')::BIGINT;
    found_base BIGINT;
BEGIN
    IF cluster IS NULL THEN
        -- Read from pg_control once per session, then remembered.
        SELECT system_identifier INTO cluster FROM pg_control_system();
        PERFORM set_config('plan_intake.system_identifier', cluster::text, false);
    END IF;
    SELECT base INTO found_base FROM feed_bases WHERE system_identifier = cluster;
    IF FOUND THEN
        RETURN found_base;
    END IF;
    found_base := GREATEST(0, COALESCE((SELECT MAX(feed_xid) FROM plans), 0) + 1
                              - pg_snapshot_xmax(pg_current_snapshot())::text::bigint);
    IF p_record THEN
        INSERT INTO feed_bases (system_identifier, base) VALUES (cluster, found_base)
            ON CONFLICT (system_identifier) DO NOTHING;
        SELECT base INTO found_base FROM feed_bases WHERE system_identifier = cluster;
    END IF;
    RETURN found_base;
END
$$;

ALTER TABLE plans
    ALTER COLUMN feed_xid SET DEFAULT (pg_current_xact_id()::text::bigint + plan_intake_feed_base(true));
-- Record this cluster's base now, so that no writer has to (a first writer
-- would make every other one wait for its commit). After a restore the
-- service records the new cluster's base when it starts.
SELECT plan_intake_feed_base(true);

-- The feed's horizon: positions below it are settled for good. It is the
-- lowest transaction id among the writers of `plans` still running (found
-- in pg_locks, so unrelated transactions of the cluster hold nothing back),
-- or the next transaction id, plus the base. Called in a statement of its
-- own, before the page is read with a newer snapshot: a writer missing from
-- pg_locks has finished and is visible to that snapshot. Also returns the
-- age of the oldest such writer, in seconds (the feed's lag).
CREATE FUNCTION plan_intake_feed_horizon(OUT horizon BIGINT, OUT lag_seconds DOUBLE PRECISION)
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

-- Readers waiting on the feed (`wait=S`) are woken by a notification sent
-- when a transaction that inserted plans commits (NOTIFY is delivered at
-- COMMIT, once per transaction and channel).
CREATE FUNCTION plan_intake_notify() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_notify('plan_intake_receipts', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER plans_notify_tg AFTER INSERT ON plans
    FOR EACH STATEMENT EXECUTE FUNCTION plan_intake_notify();
