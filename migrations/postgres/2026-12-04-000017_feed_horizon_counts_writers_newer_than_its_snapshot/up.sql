-- The horizon reads its snapshot's xmax first and pg_locks after: a writer
-- that took its id in between has an id at or past that xmax. 000008 took
-- such an id for one of the previous xid epoch and put the horizon 2^32
-- below every position, so the page read nothing while writers kept
-- starting (under load, the log's appender and readers met empty pages
-- for a second at a time). An id is now placed by its distance from the
-- xmax, both ways (a 32-bit id is within 2^31 of it): a newer writer lands
-- past the xmax, where LEAST ignores it, and one of the previous epoch
-- still lands below.
--
-- A writer's id is published (pg_stat_activity.backend_xid) a moment
-- before the lock on it is (pg_locks' transactionid): 000008 joined on the
-- lock and so dropped a writer caught in between, and the horizon could
-- pass it. Every holder of the `plans` lock now counts, its id from the
-- lock or else from the backend. One with neither takes its id after this
-- read, so after the snapshot: at or past its xmax. The statistics
-- snapshot is cleared first, so the backend's id is read now and not
-- earlier in this transaction.
CREATE OR REPLACE FUNCTION plan_intake_feed_horizon(OUT horizon BIGINT, OUT lag_seconds DOUBLE PRECISION)
LANGUAGE plpgsql
AS $$
DECLARE
    next_xid BIGINT := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    oldest   BIGINT;
BEGIN
    PERFORM pg_stat_clear_snapshot();
    SELECT MIN(next_xid
               + ((((w.xid - (next_xid & 4294967295)) + 2147483648) % 4294967296 + 4294967296)
                  % 4294967296)
               - 2147483648),
           COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - MIN(w.xact_start)), 0)
      INTO oldest, lag_seconds
      FROM (SELECT COALESCE(x.transactionid, a.backend_xid)::text::bigint AS xid,
                   a.xact_start
              FROM pg_locks r
              LEFT JOIN pg_locks x
                ON x.virtualtransaction = r.virtualtransaction
               AND x.locktype = 'transactionid' AND x.mode = 'ExclusiveLock' AND x.granted
              LEFT JOIN pg_stat_activity a ON a.pid = r.pid
             WHERE r.locktype = 'relation' AND r.relation = 'plans'::regclass
               AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND r.mode = 'RowExclusiveLock' AND r.granted) w
     WHERE w.xid IS NOT NULL;
    horizon := LEAST(next_xid, COALESCE(oldest, next_xid)) + plan_intake_feed_base(false);
END
$$;
