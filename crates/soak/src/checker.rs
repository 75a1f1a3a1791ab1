//! The checker: the history and the database at the end, held to the
//! promise. One line per violation.

use std::collections::{HashMap, HashSet};

use crate::history::History;
use crate::system::System;

pub fn check(
    system: &System,
    history: &History,
    followed: &[String],
) -> Result<Vec<String>, String> {
    let mut violations = Vec::new();
    let submits = history.of_kind("submit");
    // The database's plans, in feed order.
    let feed = system.query("SELECT receipt_id FROM plans ORDER BY feed_xid, id")?;
    let mut stored: HashMap<&str, usize> = HashMap::new();
    for id in &feed {
        *stored.entry(id.as_str()).or_default() += 1;
    }
    // Each key answers one receipt; each plan (a planner's run) one
    // receipt, whatever key it came under; every acknowledged receipt is
    // stored exactly once.
    let mut by_key: HashMap<(u64, String), HashSet<String>> = HashMap::new();
    let mut by_plan: HashMap<(u64, String), HashSet<String>> = HashMap::new();
    let mut acknowledged: Vec<String> = Vec::new();
    for event in &submits {
        let planner = event["planner"].as_u64().unwrap_or(u64::MAX);
        // Every fault ends within a few seconds and a submit tries for 30:
        // an honest service answers every one of them.
        if let Some(error) = event["error"].as_str() {
            violations.push(format!(
                "planner {planner}'s {} of {} ({} to instance {}) was never acknowledged: {error}",
                event["why"], event["run_id"], event["key"], event["instance"]
            ));
            continue;
        }
        let Some(receipt) = event["receipt_id"].as_str() else {
            violations.push(format!("an acknowledgement without a receipt: {event}"));
            continue;
        };
        let key = event["key"].as_str().unwrap_or_default().to_owned();
        let run = event["run_id"].as_str().unwrap_or_default().to_owned();
        by_key
            .entry((planner, key))
            .or_default()
            .insert(receipt.to_owned());
        by_plan
            .entry((planner, run))
            .or_default()
            .insert(receipt.to_owned());
        acknowledged.push(receipt.to_owned());
    }
    for ((planner, key), receipts) in &by_key {
        if receipts.len() > 1 {
            violations.push(format!(
                "planner {planner}'s key {key} answered {} receipts: {receipts:?}",
                receipts.len()
            ));
        }
    }
    for ((planner, run), receipts) in &by_plan {
        if receipts.len() > 1 {
            violations.push(format!(
                "planner {planner}'s plan {run} has {} receipts: {receipts:?}",
                receipts.len()
            ));
        }
    }
    let mut seen = HashSet::new();
    for receipt in &acknowledged {
        if !seen.insert(receipt) {
            continue;
        }
        match stored.get(receipt.as_str()) {
            Some(1) => {}
            Some(n) => violations.push(format!("receipt {receipt} is stored {n} times")),
            None => violations.push(format!("acknowledged receipt {receipt} is not stored")),
        }
    }
    // The follower handed on the feed: every receipt, in its order, once.
    if followed != feed.as_slice() {
        let handed: HashSet<&String> = followed.iter().collect();
        let in_feed: HashSet<&String> = feed.iter().collect();
        let missing = feed.iter().filter(|id| !handed.contains(id)).count();
        let not_in_feed = handed.iter().filter(|id| !in_feed.contains(*id)).count();
        let repeated = followed.len() - handed.len();
        violations.push(format!(
            "the follower handed on {} receipts, the feed holds {}: {missing} missing, {not_in_feed} no longer in the feed, {repeated} repeated{}",
            followed.len(),
            feed.len(),
            if missing + not_in_feed + repeated == 0 { ", out of order" } else { "" }
        ));
    }
    for error in history.of_kind("follower-error") {
        violations.push(format!("the follower stopped: {}", error["error"]));
    }
    violations.extend(system.crashes());
    for fault in history.of_kind("fault") {
        if let Some(error) = fault["error"].as_str() {
            violations.push(format!("after {}: {error}", fault["fault"]));
        }
    }
    Ok(violations)
}
