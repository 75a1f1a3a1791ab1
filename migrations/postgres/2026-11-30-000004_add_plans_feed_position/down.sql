DROP INDEX plans_feed_ix;
ALTER TABLE plans DROP COLUMN feed_xid;
