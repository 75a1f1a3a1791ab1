DROP TABLE plan_intake_inbox_position;
DROP TABLE plan_intake_inbox;
