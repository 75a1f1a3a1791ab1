//! Many instances through a real PgBouncer in transaction mode: 8 services
//! (`serve --no-migrate --pg-pooler transaction`) share one PgBouncer in
//! front of one Postgres.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread;

use diesel::{Connection, PgConnection};
use plan_intake::storage::DbConn;

use crate::support::load::{Load, assert_each_answered, resend};
use crate::support::pgbouncer::PgBouncer;
use crate::support::process::{ServeProcess, client, get, post_plan, run_cli_at};
use crate::support::{plan_body, scalar};

const INSTANCES: usize = 8;

/// PgBouncer, a migrated database behind it, two logins, and 8 services.
struct Fleet {
    bouncer: PgBouncer,
    planner: String,
    orders: String,
    services: Vec<ServeProcess>,
}

impl Fleet {
    fn start() -> Option<Self> {
        let bouncer = PgBouncer::start()?;
        let direct = bouncer.direct_url();
        let migrated = run_cli_at(&direct, &["migrate", "run"]);
        assert!(
            migrated.status.success(),
            "{}",
            String::from_utf8_lossy(&migrated.stderr)
        );
        let token = |name: &str, permission: &str| {
            let out = run_cli_at(
                &direct,
                &["logins", "add", name, "--permission", permission],
            );
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        let (planner, orders) = (
            token("planner-a", "plans:submit"),
            token("orders", "receipts:read"),
        );
        let services = (0..INSTANCES)
            .map(|_| {
                ServeProcess::start_with(
                    &bouncer.url(),
                    &[
                        "--no-migrate",
                        "--pg-pooler",
                        "transaction",
                        "--pool-size",
                        "4",
                        "--workers",
                        "1",
                    ],
                )
            })
            .collect();
        Some(Self {
            bouncer,
            planner,
            orders,
            services,
        })
    }

    fn addr(&self, i: usize) -> String {
        self.services[i % INSTANCES].addr.clone()
    }

    fn direct(&self) -> DbConn {
        DbConn::Postgres(PgConnection::establish(&self.bouncer.direct_url()).expect("connect"))
    }
}

#[test]
fn eight_instances_through_pgbouncer_keep_every_guarantee() {
    let Some(fleet) = Fleet::start() else {
        return;
    };
    let fleet = Arc::new(fleet);

    // One key, 40 times at once, over the 8 instances.
    let body = plan_body("run-one", "x");
    let answers: Vec<u16> = (0..40)
        .map(|i| {
            let (fleet, body) = (Arc::clone(&fleet), body.clone());
            thread::spawn(move || {
                post_plan(&client(), &fleet.addr(i), &fleet.planner, "one-key", &body)
                    .expect("answer")
                    .0
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    assert_eq!(
        answers.iter().filter(|s| **s == 201).count(),
        1,
        "{answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|s| **s == 200).count(),
        39,
        "{answers:?}"
    );

    // 8 × 100 new plans at once.
    let created: Vec<u16> = (0..INSTANCES)
        .map(|c| {
            let fleet = Arc::clone(&fleet);
            thread::spawn(move || {
                let agent = client();
                (0..100)
                    .map(|i| {
                        let key = format!("k-{c}-{i}");
                        let body = plan_body(&key, "x");
                        post_plan(&agent, &fleet.addr(c), &fleet.planner, &key, &body)
                            .expect("answer")
                            .0
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .flat_map(|t| t.join().expect("thread"))
        .collect();
    assert!(
        created.iter().all(|s| *s == 201),
        "{:?}",
        created.iter().filter(|s| **s != 201).collect::<Vec<_>>()
    );
    let mut conn = fleet.direct();
    assert_eq!(scalar(&mut conn, "SELECT COUNT(*) AS n FROM plans"), 801);
    assert_eq!(
        scalar(&mut conn, "SELECT COUNT(*) AS n FROM intake_keys"),
        801
    );

    // The feed, each page from another instance: every receipt once.
    let agent = client();
    let mut seen = HashSet::new();
    let mut cursor = String::new();
    for page_number in 0.. {
        let path = if cursor.is_empty() {
            "/v1/receipts?limit=97".to_owned()
        } else {
            format!("/v1/receipts?limit=97&after={cursor}")
        };
        let (status, page) = get(&agent, &fleet.addr(page_number), &fleet.orders, &path);
        assert_eq!(status, 200, "{page}");
        let receipts = page["receipts"].as_array().cloned().unwrap_or_default();
        if receipts.is_empty() {
            break;
        }
        for receipt in receipts {
            assert!(
                seen.insert(
                    receipt["receipt_id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned()
                ),
                "a receipt twice"
            );
        }
        cursor = page["next"].as_str().unwrap_or_default().to_owned();
    }
    assert_eq!(seen.len(), 801);
    for i in 0..INSTANCES {
        assert_eq!(get(&agent, &fleet.addr(i), "", "/readyz").0, 200);
    }
}

#[test]
fn pgbouncer_killed_and_restarted_under_load_loses_nothing() {
    let Some(fleet) = Fleet::start() else {
        return;
    };
    let load = Load::start(INSTANCES, &fleet.planner, |c| fleet.addr(c));
    for _ in 0..3 {
        load.wait_for_answers(100);
        fleet.bouncer.kill_9_and_restart();
    }
    load.wait_for_answers(100);
    let sent = load.stop();
    assert_each_answered(&sent, &[200, 201, 503]);

    let agent = client();
    for (i, s) in sent.iter().enumerate() {
        let (again, answer) = resend(&agent, &fleet.addr(i), &fleet.planner, s);
        assert!([200, 201].contains(&again), "{}: {again} {answer}", s.key);
        if let Some(receipt) = s.created_receipt() {
            assert_eq!(answer["receipt_id"].as_str(), Some(receipt), "{}", s.key);
        }
    }
    let mut conn = fleet.direct();
    assert_eq!(
        scalar(&mut conn, "SELECT COUNT(*) AS n FROM plans"),
        sent.len() as i64
    );
    assert_eq!(
        scalar(
            &mut conn,
            "SELECT COUNT(*) AS n FROM plans p WHERE NOT EXISTS (SELECT 1 FROM intake_keys k WHERE k.plan_id = p.id)"
        ),
        0
    );
}

/// `migrate run` through the pooler is refused in one line; the service
/// will not migrate through it either.
#[test]
fn migrations_through_a_transaction_pooler_are_refused() {
    let Some(bouncer) = PgBouncer::start() else {
        return;
    };
    let url = bouncer.url();
    let refused = crate::support::process::run_cli_at(
        &url,
        &["migrate", "run", "--pg-pooler", "transaction"],
    );
    assert!(!refused.status.success());
    let line = String::from_utf8_lossy(&refused.stderr);
    assert!(
        line.contains("connect directly") && line.trim().lines().count() == 1,
        "{line}"
    );
    let serve = crate::support::process::run_cli_at(
        &url,
        &[
            "serve",
            "--pg-pooler",
            "transaction",
            "--bind",
            "127.0.0.1:0",
        ],
    );
    assert!(!serve.status.success());
    assert!(String::from_utf8_lossy(&serve.stderr).contains("--no-migrate"));
}
