DROP FUNCTION plan_intake_write_batch(TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[],
                                      TEXT[], TIMESTAMP[], TEXT[], INTEGER[], TEXT[], TEXT[]);
