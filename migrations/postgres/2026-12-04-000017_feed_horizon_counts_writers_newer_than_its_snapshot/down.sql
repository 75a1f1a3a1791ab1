-- Back to the horizon of 000016.
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
               AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND r.mode = 'RowExclusiveLock' AND r.granted
               AND x.locktype = 'transactionid' AND x.mode = 'ExclusiveLock' AND x.granted) w
      LEFT JOIN pg_stat_activity a ON a.pid = w.pid;
    horizon := LEAST(next_xid, COALESCE(oldest, next_xid)) + plan_intake_feed_base(false);
END
$$;
