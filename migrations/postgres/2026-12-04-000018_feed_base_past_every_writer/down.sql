-- Back to the base of 000014 (from the snapshot's xmax).
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
        INSERT INTO feed_bases (system_identifier, timeline_id, base, starts_at)
             VALUES (cluster, timeline, found_base,
                     found_base + pg_snapshot_xmax(pg_current_snapshot())::text::bigint)
            ON CONFLICT (system_identifier, timeline_id) DO NOTHING;
        SELECT base INTO found_base FROM feed_bases
         WHERE system_identifier = cluster AND timeline_id = timeline;
    END IF;
    RETURN found_base;
END
$$;
