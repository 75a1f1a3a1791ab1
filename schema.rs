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
//   receipt_log: receipt_log_pk, receipt_log_receipt_id_uq; receipt_log_hashes_pk,
//                receipt_log_checkpoints_pk, receipt_log_state_pk,
//                receipt_log_state_one_row_ck; signing_keys_pk

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
        receipt_signature -> Nullable<Text>,
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

diesel::table! {
    receipt_log (leaf_index) {
        leaf_index -> BigInt,
        receipt_id -> Text,
        leaf_hash -> Binary,
    }
}

diesel::table! {
    receipt_log_hashes (hash_index) {
        hash_index -> BigInt,
        hash -> Binary,
    }
}

diesel::table! {
    receipt_log_checkpoints (tree_size) {
        tree_size -> BigInt,
        root_hash -> Binary,
        note -> Text,
        signed_at -> Timestamp,
    }
}

diesel::table! {
    receipt_log_state (id) {
        id -> BigInt,
        tree_size -> BigInt,
        after_feed_xid -> BigInt,
        after_plan_id -> BigInt,
    }
}

diesel::table! {
    signing_keys (key_id) {
        key_id -> Text,
        verifier_key -> Text,
        first_used_at -> Timestamp,
        last_used_at -> Timestamp,
    }
}

diesel::joinable!(intake_keys -> plans (plan_id));

diesel::allow_tables_to_appear_in_same_query!(
    logins,
    plans,
    intake_keys,
    receipt_log,
    receipt_log_hashes,
    receipt_log_checkpoints,
    receipt_log_state,
    signing_keys,
);
