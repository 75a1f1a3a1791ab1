DROP TRIGGER plans_notify_tg ON plans;
DROP FUNCTION plan_intake_notify();
DROP FUNCTION plan_intake_feed_horizon();
ALTER TABLE plans
    ALTER COLUMN feed_xid SET DEFAULT (pg_current_xact_id()::text::bigint);
DROP FUNCTION plan_intake_feed_base(BOOLEAN);
DROP TABLE feed_bases;
