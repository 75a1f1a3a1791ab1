-- Back to one base per cluster: the latest timeline's.
DELETE FROM feed_bases b
 WHERE EXISTS (SELECT 1 FROM feed_bases n
                WHERE n.system_identifier = b.system_identifier AND n.timeline_id > b.timeline_id);
ALTER TABLE feed_bases DROP CONSTRAINT feed_bases_pk;
ALTER TABLE feed_bases DROP COLUMN timeline_id;
ALTER TABLE feed_bases ADD CONSTRAINT feed_bases_pk PRIMARY KEY (system_identifier);

CREATE OR REPLACE FUNCTION plan_intake_feed_base(p_record BOOLEAN) RETURNS BIGINT
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

DROP FUNCTION plan_intake_timeline();
