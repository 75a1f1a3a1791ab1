-- One row per plan kept: the plan and its receipt.
CREATE TABLE plans (
    id              BIGINT    GENERATED ALWAYS AS IDENTITY,
    receipt_id      TEXT      NOT NULL,
    maker           TEXT      NOT NULL,
    run_id          TEXT      NOT NULL,
    content_hash    TEXT      NOT NULL,
    request_hash    TEXT      NOT NULL,
    content         TEXT      NOT NULL,
    approved_inputs TEXT      NOT NULL,
    permissions     TEXT      NOT NULL,
    received_at     TIMESTAMP NOT NULL,
    CONSTRAINT plans_pk PRIMARY KEY (id),
    CONSTRAINT plans_receipt_id_uq UNIQUE (receipt_id),
    -- Settles "new key, same plan": run_id is NOT NULL, so two plans without
    -- a run can never slip past this rule as two distinct NULLs.
    CONSTRAINT plans_maker_run_content_uq UNIQUE (maker, run_id, content_hash),
    CONSTRAINT plans_run_id_not_blank_ck CHECK (run_id ~ '\S')
);
