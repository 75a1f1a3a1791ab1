-- The receipts feed orders plans by (feed_xid, id). SQLite has one writer at
-- a time (BEGIN IMMEDIATE), so ids commit in order and feed_xid stays 0.
ALTER TABLE plans ADD COLUMN feed_xid INTEGER NOT NULL DEFAULT 0;
CREATE INDEX plans_feed_ix ON plans (feed_xid, id);
