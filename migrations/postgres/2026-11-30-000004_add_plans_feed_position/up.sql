-- The receipts feed orders plans by (feed_xid, id). feed_xid is the writing
-- transaction's id; a reader only returns rows whose transaction is older
-- than every transaction still running (its snapshot's xmin), so a plan whose
-- transaction commits late can never land behind a reader's cursor.
ALTER TABLE plans
    ADD COLUMN feed_xid BIGINT NOT NULL DEFAULT (pg_current_xact_id()::text::bigint);
CREATE INDEX plans_feed_ix ON plans (feed_xid, id);
