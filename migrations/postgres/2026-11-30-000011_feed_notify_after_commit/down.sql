-- Back to the statement trigger that notifies inside every write.
CREATE FUNCTION plan_intake_notify() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_notify('plan_intake_receipts', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER plans_notify_tg AFTER INSERT ON plans
    FOR EACH STATEMENT EXECUTE FUNCTION plan_intake_notify();
