-- The ordering system's inbox: every receipt of plan-intake's feed exactly
-- once, in feed order, kept by `plan-intake follow --into` in one
-- transaction with the follower's position. The tables are the consumer's.
CREATE TABLE plan_intake_inbox (
    -- Feed order (one follower writes an inbox, a page at a time).
    inbox_seq INTEGER PRIMARY KEY AUTOINCREMENT,
    receipt_id TEXT NOT NULL UNIQUE,
    -- The receipt as sent, byte for byte (signature and unknown members
    -- included): `plan-intake receipts verify` checks it offline.
    receipt TEXT NOT NULL,
    -- With --expand: the plan's inputs and content, as the service stored them.
    approved_inputs TEXT,
    content TEXT,
    inserted_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    -- The ordering system's own: set when it has processed the row.
    processed_at TEXT
);

CREATE INDEX plan_intake_inbox_unprocessed ON plan_intake_inbox (inbox_seq)
    WHERE processed_at IS NULL;

-- One row, made here (so that a page's transaction always finds it to
-- lock): where the follower stands after the last page kept.
CREATE TABLE plan_intake_inbox_position (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
    -- Opaque: the feed cursor and, with --verify, the proof so far;
    -- NULL until the first page.
    position TEXT,
    -- With --verify: the receipts proven to be the signed log's leaves,
    -- and the last checkpoint met (SIZE ROOT ORIGIN).
    verified_leaves INTEGER,
    checkpoint TEXT,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

INSERT INTO plan_intake_inbox_position (singleton) VALUES (1);
