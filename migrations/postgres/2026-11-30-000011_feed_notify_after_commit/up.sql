-- No NOTIFY inside the write: a transaction that has queued a notification
-- takes one lock for the whole cluster before it commits and holds it until
-- its commit is flushed, so the trigger serialized every write (and every
-- other NOTIFY on the cluster). Each service instance now notifies from a
-- connection of its own after its writes have committed, coalesced
-- (`storage::feed_signal`).
DROP TRIGGER plans_notify_tg ON plans;
DROP FUNCTION plan_intake_notify();
