-- A base recorded by a writer places every writer past every stored
-- position. A position is a writer's transaction id plus the base, so the
-- base must be MAX(feed_xid) + 1 minus the LOWEST id that may still write:
-- the recording snapshot's xmin (the oldest transaction running, the
-- recorder itself included), not its xmax. 000008 took xmax, and a writer
-- whose own id is below it (one that took its id before another, newer
-- transaction ended) landed at or below MAX, behind a cursor already
-- handed out (000008's comment has the inequality the wrong way round).
-- Without p_record (the horizon, before any base is recorded) the estimate
-- stays MAX(feed_xid) + 1 - xmax: a horizon of at most MAX + 1, never past
-- a position a later recorder gives, since xmin <= xmax. A timeline's start
-- is then the recorder's MAX + 1 (its base plus xmin; the lowest id itself
-- when the base is 0), which no writer of that timeline goes below.
CREATE OR REPLACE FUNCTION plan_intake_feed_base(p_record BOOLEAN) RETURNS BIGINT
LANGUAGE plpgsql
AS $$
DECLARE
    cluster  BIGINT := NULLIF(current_setting('plan_intake.system_identifier', true), '')::BIGINT;
    timeline BIGINT := plan_intake_timeline();
    found_base BIGINT;
    lowest     BIGINT;
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
    IF p_record THEN
        -- The lowest id that may still write: the oldest running (this
        -- transaction's own included, if it has one).
        lowest := LEAST(pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
                        COALESCE(pg_current_xact_id_if_assigned()::text::bigint,
                                 pg_snapshot_xmin(pg_current_snapshot())::text::bigint));
    ELSE
        lowest := pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    END IF;
    found_base := GREATEST(0, COALESCE((SELECT MAX(feed_xid) FROM plans), 0) + 1 - lowest);
    IF EXISTS (SELECT 1 FROM feed_bases WHERE system_identifier = cluster) THEN
        -- A new timeline of this cluster: leave room for what the old one
        -- may have handed out past what was replayed here.
        found_base := found_base + 4294967296;
    END IF;
    IF p_record THEN
        INSERT INTO feed_bases (system_identifier, timeline_id, base, starts_at)
             VALUES (cluster, timeline, found_base, found_base + lowest)
            ON CONFLICT (system_identifier, timeline_id) DO NOTHING;
        SELECT base INTO found_base FROM feed_bases
         WHERE system_identifier = cluster AND timeline_id = timeline;
    END IF;
    RETURN found_base;
END
$$;
