// The tables as a fresh database built by `migrations/` holds them; one file
// serves both backends (`tests/it/schema.rs` checks it against the live catalog).
//
// Pinned names (the migrations create them; the README lists them):
//   logins:      logins_pk, logins_token_hash_uq, logins_name_not_blank_ck,
//                logins_previous_token_hash_uq
//   plans:       plans_pk, plans_receipt_id_uq, plans_maker_run_content_uq,
//                plans_run_id_not_blank_ck, plans_feed_ix
//   intake_keys: intake_keys_pk, intake_keys_maker_key_uq, intake_keys_plan_id_fk,
//                intake_keys_plan_id_ix

diesel::table! {
    logins (name) {
        name -> Text,
        token_hash -> Text,
        permissions -> Text,
        created_at -> Timestamp,
        revoked_at -> Nullable<Timestamp>,
        previous_token_hash -> Nullable<Text>,
        previous_token_expires_at -> Nullable<Timestamp>,
    }
}

diesel::table! {
    plans (id) {
        id -> BigInt,
        receipt_id -> Text,
        maker -> Text,
        run_id -> Text,
        content_hash -> Text,
        request_hash -> Text,
        content -> Text,
        approved_inputs -> Text,
        permissions -> Text,
        received_at -> Timestamp,
        feed_xid -> BigInt,
    }
}

diesel::table! {
    intake_keys (id) {
        id -> BigInt,
        maker -> Text,
        idempotency_key -> Text,
        request_hash -> Text,
        plan_id -> BigInt,
        created_at -> Timestamp,
    }
}

diesel::joinable!(intake_keys -> plans (plan_id));

diesel::allow_tables_to_appear_in_same_query!(logins, plans, intake_keys);
