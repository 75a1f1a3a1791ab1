-- One row per plan kept: the plan and its receipt.
-- AUTOINCREMENT: ids grow in insertion order and are never reused.
CREATE TABLE plans (
    id              INTEGER   NOT NULL CONSTRAINT plans_pk PRIMARY KEY AUTOINCREMENT,
    receipt_id      TEXT      NOT NULL,
    maker           TEXT      NOT NULL,
    run_id          TEXT      NOT NULL,
    content_hash    TEXT      NOT NULL,
    request_hash    TEXT      NOT NULL,
    content         TEXT      NOT NULL,
    approved_inputs TEXT      NOT NULL,
    permissions     TEXT      NOT NULL,
    received_at     TIMESTAMP NOT NULL,
    CONSTRAINT plans_run_id_not_blank_ck CHECK (trim(run_id, ' ' || char(9, 10, 13)) <> '')
);
CREATE UNIQUE INDEX plans_receipt_id_uq ON plans (receipt_id);
-- Settles "new key, same plan": run_id is NOT NULL, so two plans without
-- a run can never slip past this rule as two distinct NULLs.
CREATE UNIQUE INDEX plans_maker_run_content_uq ON plans (maker, run_id, content_hash);
