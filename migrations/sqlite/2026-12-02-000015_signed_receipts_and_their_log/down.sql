DROP TABLE signing_keys;
DROP TABLE receipt_log_state;
DROP TABLE receipt_log_checkpoints;
DROP TABLE receipt_log_hashes;
DROP TABLE receipt_log;
ALTER TABLE plans DROP COLUMN receipt_signature;
