//! The shipped alerts and dashboard (`deploy/`) against a real Prometheus
//! scraping the real binary under a little load: Prometheus loads the
//! rules, every series and label they and the dashboard name exists (no
//! misspelt series, no label the service does not export), and every
//! dashboard expression returns data.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::process::{client, free_port, post_plan, served_sqlite};
use crate::support::{REQUIRE_POSTGRES_VAR, plan_body};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Prometheus from Debian's package; `None` (and a loud notice) when it is
/// not installed, a failure when the suite is required to run everything.
fn prometheus_binary() -> Option<&'static str> {
    let found = Command::new("prometheus")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if found {
        return Some("prometheus");
    }
    if std::env::var_os(REQUIRE_POSTGRES_VAR).is_some() {
        panic!(
            "{REQUIRE_POSTGRES_VAR} is set but prometheus is not installed (apt-get install prometheus)"
        );
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "\n!!!!!!!!\n!!! SKIPPING the monitoring test: prometheus is not installed (apt-get install prometheus).\n!!!!!!!!\n"
    );
    None
}

struct Prometheus {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(binary: &str, target: &str) -> Self {
        let dir = tempfile::tempdir().expect("a directory for prometheus");
        let rules = format!("{ROOT}/deploy/prometheus/plan-intake.rules.yml");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\nscrape_configs:\n  - job_name: plan-intake\n    static_configs:\n      - targets: ['{target}']\n"
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write the config");
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus");
        Self {
            child,
            addr,
            _dir: dir,
        }
    }

    /// An instant query: Prometheus's `data.result`, or its error.
    fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let response = ureq::get(&format!("http://{}/api/v1/query", self.addr))
            .query("query", expr)
            .call();
        let text = match response {
            Ok(response) => response.into_string(),
            Err(ureq::Error::Status(_, response)) => response.into_string(),
            Err(e) => return Err(e.to_string()),
        }
        .map_err(|e| e.to_string())?;
        let body: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(text);
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    fn get(&self, path: &str) -> serde_json::Value {
        let text = ureq::get(&format!("http://{}{path}", self.addr))
            .call()
            .ok()
            .and_then(|r| r.into_string().ok())
            .unwrap_or_default();
        serde_json::from_str(&text).unwrap_or_default()
    }

    /// Waits until `expr` returns data, up to `within`.
    fn wait_for(&self, expr: &str, within: Duration) {
        let started = Instant::now();
        loop {
            if self.query(expr).is_ok_and(|result| !result.is_empty()) {
                return;
            }
            assert!(
                started.elapsed() < within,
                "no data for {expr} after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Every series selector an expression names (`metric` or
/// `metric{labels}`): each must select something on its own.
fn selectors(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let is_name = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut found = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let starts_name = (at == 0 || !is_name(bytes[at - 1]))
            && (expr[at..].starts_with("plan_intake_") || expr[at..].starts_with("up{"));
        if !starts_name {
            at += 1;
            continue;
        }
        let mut end = at;
        while end < bytes.len() && is_name(bytes[end]) {
            end += 1;
        }
        if bytes.get(end) == Some(&b'{') {
            end += expr[end..].find('}').map_or(0, |close| close + 1);
        }
        found.push(expr[at..end].to_owned());
        at = end;
    }
    found
}

fn rule_expressions() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(format!("{ROOT}/deploy/prometheus/plan-intake.rules.yml"))
        .expect("the rules");
    let mut alert = String::new();
    let mut found = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("- alert:") {
            alert = name.trim().to_owned();
        } else if let Some(expr) = line.strip_prefix("expr:") {
            found.push((alert.clone(), expr.trim().to_owned()));
        }
    }
    found
}

fn dashboard_expressions() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(format!("{ROOT}/deploy/grafana/plan-intake.dashboard.json"))
        .expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut found = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            found.push((
                panel["title"].as_str().unwrap_or_default().to_owned(),
                target["expr"].as_str().expect("an expr").to_owned(),
            ));
        }
    }
    found
}

/// Each alert's `runbook_url` is a link an on-call engineer can follow
/// from a page: on the project's repository (Cargo.toml's `repository`),
/// to a heading of OPERATIONS.md that exists (GitHub's anchor for it).
#[test]
fn every_alert_links_to_its_runbook() {
    let rules = std::fs::read_to_string(format!("{ROOT}/deploy/prometheus/plan-intake.rules.yml"))
        .expect("the rules");
    let manifest = std::fs::read_to_string(format!("{ROOT}/Cargo.toml")).expect("Cargo.toml");
    let repository = manifest
        .lines()
        .find_map(|line| line.strip_prefix("repository = "))
        .expect("a repository in Cargo.toml")
        .trim_matches('"');
    let operations =
        std::fs::read_to_string(format!("{ROOT}/docs/OPERATIONS.md")).expect("OPERATIONS.md");
    // GitHub's anchor: lowercased, spaces to hyphens, other punctuation gone.
    let anchors: Vec<String> = operations
        .lines()
        .filter_map(|line| line.strip_prefix('#'))
        .map(|heading| {
            heading
                .trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let page = format!("{repository}/blob/main/docs/OPERATIONS.md#");
    let mut alerts: Vec<(String, Option<String>)> = Vec::new();
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert:") {
            alerts.push((name.trim().to_owned(), None));
        } else if let Some(url) = line.strip_prefix("runbook_url:")
            && let Some((_, link)) = alerts.last_mut()
        {
            *link = Some(url.trim().trim_matches('"').to_owned());
        }
    }
    assert_eq!(alerts.len(), 13, "{alerts:?}");
    for (alert, link) in &alerts {
        let link = link
            .as_deref()
            .unwrap_or_else(|| panic!("{alert} has no runbook_url"));
        let anchor = link
            .strip_prefix(&page)
            .unwrap_or_else(|| panic!("{alert}'s runbook_url {link} is not on {page}"));
        assert!(
            anchors.iter().any(|a| a == anchor),
            "{alert}'s runbook_url names #{anchor}, which no heading of OPERATIONS.md makes"
        );
        assert_eq!(anchor, alert.to_lowercase(), "{alert}: its own section");
    }
}

#[test]
fn selectors_are_found_in_expressions() {
    assert_eq!(
        selectors(
            r#"sum by (le) (rate(plan_intake_x_bucket{job="a", b="c"}[5m])) / up{job="p"} + plan_intake_y"#
        ),
        vec![
            r#"plan_intake_x_bucket{job="a", b="c"}"#,
            r#"up{job="p"}"#,
            "plan_intake_y"
        ]
    );
}

#[test]
fn prometheus_finds_every_series_the_alerts_and_dashboard_name() {
    let Some(binary) = prometheus_binary() else {
        return;
    };
    let (_app, server, planner, reader) = served_sqlite();
    let prometheus = Prometheus::start(binary, &server.addr);
    prometheus.wait_for(r#"up{job="plan-intake"} == 1"#, Duration::from_secs(60));

    // A little load over a few scrapes: new plans, replays, feed pages, a
    // stranger.
    let agent = client();
    for round in 0..5 {
        for i in 0..10 {
            let key = format!("k-{round}-{i}");
            let (status, _) =
                post_plan(&agent, &server.addr, &planner, &key, &plan_body(&key, "x"))
                    .expect("an answer");
            assert_eq!(status, 201);
            let (status, _) =
                post_plan(&agent, &server.addr, &planner, &key, &plan_body(&key, "x"))
                    .expect("an answer");
            assert_eq!(status, 200);
        }
        let (status, _) =
            crate::support::process::get(&agent, &server.addr, &reader, "/v1/receipts?limit=10");
        assert_eq!(status, 200);
        let (status, _) =
            post_plan(&agent, &server.addr, "pit_stranger", "k", "{}").expect("an answer");
        assert_eq!(status, 401);
        let _ = agent.get(&format!("http://{}/readyz", server.addr)).call();
        std::thread::sleep(Duration::from_millis(700));
    }
    // The last of the load is in two scrapes at least.
    prometheus.wait_for(
        r#"increase(plan_intake_outcomes_total{job="plan-intake", outcome="replayed"}[1m]) > 0"#,
        Duration::from_secs(30),
    );

    // Prometheus loaded every rule, and evaluates each without error.
    let expressions = rule_expressions();
    assert!(expressions.len() >= 8, "{expressions:?}");
    let started = Instant::now();
    let rules = loop {
        let groups = prometheus.get("/api/v1/rules");
        let rules: Vec<serde_json::Value> = groups["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = rules.len() == expressions.len()
            && rules.iter().all(|r| {
                r["lastEvaluation"]
                    .as_str()
                    .is_some_and(|t| !t.starts_with("0001"))
            });
        if evaluated || started.elapsed() > Duration::from_secs(30) {
            break rules;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!(rules.len(), expressions.len(), "{rules:?}");
    for rule in &rules {
        assert_eq!(rule["health"], "ok", "{rule}");
    }

    let mut missing = Vec::new();
    for (whose, expr) in expressions.iter().chain(&dashboard_expressions()) {
        if let Err(error) = prometheus.query(expr) {
            missing.push(format!("{whose}: {expr}: {error}"));
        }
        for selector in selectors(expr) {
            match prometheus.query(&format!("count({selector})")) {
                Ok(result) if !result.is_empty() => {}
                other => missing.push(format!("{whose}: {selector} selects nothing ({other:?})")),
            }
        }
    }
    for (panel, expr) in dashboard_expressions() {
        match prometheus.query(&expr) {
            Ok(result) if !result.is_empty() => {}
            other => missing.push(format!(
                "dashboard {panel}: {expr} returns no data ({other:?})"
            )),
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
