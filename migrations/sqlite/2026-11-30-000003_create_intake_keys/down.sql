DROP TABLE intake_keys;
