-- One row per (maker, idempotency key), written in the same transaction as its plan.
CREATE TABLE intake_keys (
    id              INTEGER   NOT NULL CONSTRAINT intake_keys_pk PRIMARY KEY AUTOINCREMENT,
    maker           TEXT      NOT NULL,
    idempotency_key TEXT      NOT NULL,
    request_hash    TEXT      NOT NULL,
    plan_id         BIGINT    NOT NULL,
    created_at      TIMESTAMP NOT NULL,
    CONSTRAINT intake_keys_plan_id_fk FOREIGN KEY (plan_id) REFERENCES plans (id)
);
CREATE UNIQUE INDEX intake_keys_maker_key_uq ON intake_keys (maker, idempotency_key);
CREATE INDEX intake_keys_plan_id_ix ON intake_keys (plan_id);
