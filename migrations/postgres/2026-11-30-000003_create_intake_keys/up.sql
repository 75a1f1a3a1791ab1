-- One row per (maker, idempotency key), written in the same transaction as its plan.
CREATE TABLE intake_keys (
    id              BIGINT    GENERATED ALWAYS AS IDENTITY,
    maker           TEXT      NOT NULL,
    idempotency_key TEXT      NOT NULL,
    request_hash    TEXT      NOT NULL,
    plan_id         BIGINT    NOT NULL,
    created_at      TIMESTAMP NOT NULL,
    CONSTRAINT intake_keys_pk PRIMARY KEY (id),
    CONSTRAINT intake_keys_maker_key_uq UNIQUE (maker, idempotency_key),
    CONSTRAINT intake_keys_plan_id_fk FOREIGN KEY (plan_id) REFERENCES plans (id)
);
CREATE INDEX intake_keys_plan_id_ix ON intake_keys (plan_id);
