-- Feed positions that survive a failover. A promoted standby goes on from
-- the transaction ids it had replayed; an asynchronous one that was behind
-- then hands out again ids its old primary had already used, so positions
-- written on the new timeline would fall below cursors readers took from the
-- old primary, and those readers would skip them for good. So a base is
-- kept per cluster and timeline: the first on a new timeline of a cluster
-- that wrote before leaves room for 2^32 transaction ids the old timeline
-- may have assigned after the last one this node saw.

-- The timeline this server writes on now. In recovery it has none of its
-- own; the last checkpoint's is the one its positions were written on. Read
-- per call, not per session: a session survives its server's promotion.
CREATE FUNCTION plan_intake_timeline() RETURNS BIGINT
LANGUAGE sql
AS $$
    SELECT CASE WHEN pg_is_in_recovery()
                THEN (SELECT timeline_id FROM pg_control_checkpoint())::bigint
                ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int::bigint
           END
$$;

ALTER TABLE feed_bases ADD COLUMN timeline_id BIGINT;
UPDATE feed_bases SET timeline_id = plan_intake_timeline();
ALTER TABLE feed_bases ALTER COLUMN timeline_id SET NOT NULL;
ALTER TABLE feed_bases DROP CONSTRAINT feed_bases_pk;
ALTER TABLE feed_bases ADD CONSTRAINT feed_bases_pk PRIMARY KEY (system_identifier, timeline_id);

CREATE OR REPLACE FUNCTION plan_intake_feed_base(p_record BOOLEAN) RETURNS BIGINT
LANGUAGE plpgsql
AS $$
DECLARE
    cluster  BIGINT := NULLIF(current_setting('plan_intake.system_identifier', true), '')::BIGINT;
    timeline BIGINT := plan_intake_timeline();
    found_base BIGINT;
BEGIN
    IF cluster IS NULL THEN
        -- Read from pg_control once per session, then remembered (a
        -- promotion keeps it).
        SELECT system_identifier INTO cluster FROM pg_control_system();
        PERFORM set_config('plan_intake.system_identifier', cluster::text, false);
    END IF;
    SELECT base INTO found_base FROM feed_bases
     WHERE system_identifier = cluster AND timeline_id = timeline;
    IF FOUND THEN
        RETURN found_base;
    END IF;
    found_base := GREATEST(0, COALESCE((SELECT MAX(feed_xid) FROM plans), 0) + 1
                              - pg_snapshot_xmax(pg_current_snapshot())::text::bigint);
    IF EXISTS (SELECT 1 FROM feed_bases WHERE system_identifier = cluster) THEN
        -- A new timeline of this cluster: leave room for what the old one
        -- may have handed out past what was replayed here.
        found_base := found_base + 4294967296;
    END IF;
    IF p_record THEN
        INSERT INTO feed_bases (system_identifier, timeline_id, base)
             VALUES (cluster, timeline, found_base)
            ON CONFLICT (system_identifier, timeline_id) DO NOTHING;
        SELECT base INTO found_base FROM feed_bases
         WHERE system_identifier = cluster AND timeline_id = timeline;
    END IF;
    RETURN found_base;
END
$$;
