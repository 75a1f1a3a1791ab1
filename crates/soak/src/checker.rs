//! The checker: the history and the database at the end, held to the
//! promise. One line per violation.

use std::collections::{HashMap, HashSet};

use crate::history::History;
use crate::system::System;

/// What the summary says besides the faults: each reader's count, its
/// kills and repeats, and the answers the instances gave by status.
pub fn notes(system: &System, history: &History) -> Vec<String> {
    let mut notes = Vec::new();
    let cuts = history.of_kind("commit cut");
    if !cuts.is_empty() {
        notes.push(format!(
            "soak: cut after a COMMIT: {} of {} armed cuts found a COMMIT",
            cuts.iter().filter(|cut| cut["fired"] == true).count(),
            cuts.len()
        ));
    }
    let cancelled = history.of_kind("waits cancelled");
    if !cancelled.is_empty() {
        notes.push(format!(
            "soak: commits' waits for the standby cancelled: {} (before {} failovers)",
            cancelled
                .iter()
                .filter_map(|c| c["cancelled"].as_u64())
                .sum::<u64>(),
            cancelled.len()
        ));
    }
    let stops = history.of_kind("stop");
    if !stops.is_empty() {
        notes.push(format!(
            "soak: SIGSTOP: {} of {} stops as a statement writing plans left (mid-batch)",
            stops
                .iter()
                .filter(|stop| stop["mid_batch"] == true)
                .count(),
            stops.len()
        ));
    }
    for reader in &system.readers {
        let (handed, torn) = reader.handed_on();
        let unique: HashSet<&String> = handed.iter().collect();
        notes.push(format!(
            "soak: reader {}: {} receipts handed on, {} again after {} kills ({torn} torn lines)",
            reader.name,
            unique.len(),
            handed.len() - unique.len(),
            reader.kills.lock().map(|k| *k).unwrap_or(0)
        ));
    }
    let mut statuses: std::collections::BTreeMap<u64, usize> = Default::default();
    system.each_request_line(|line| {
        *statuses
            .entry(line["status"].as_u64().unwrap_or(0))
            .or_default() += 1;
    });
    notes.push(format!(
        "soak: answers by status: {}",
        statuses
            .iter()
            .map(|(status, n)| format!("{status} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    notes
}

pub fn check(
    system: &System,
    history: &History,
    followed: &[String],
) -> Result<Vec<String>, String> {
    let mut violations = Vec::new();
    // The database's plans, in feed order.
    let feed = system.query("SELECT receipt_id FROM plans ORDER BY feed_xid, id")?;
    let mut stored: HashMap<&str, usize> = HashMap::new();
    for id in &feed {
        *stored.entry(id.as_str()).or_default() += 1;
    }
    // Each acknowledged plan is stored as it was sent.
    let stored_hashes: HashMap<String, String> = system
        .query("SELECT receipt_id || ' ' || request_hash FROM plans")?
        .into_iter()
        .filter_map(|row| {
            row.split_once(' ')
                .map(|(id, hash)| (id.to_owned(), hash.to_owned()))
        })
        .collect();
    // Each key answers one receipt; each plan (a planner's run) one
    // receipt, whatever key it came under; every acknowledged receipt is
    // stored exactly once. One pass over the submissions as the history
    // file holds them, keeping a few bytes each (a long run makes
    // millions).
    let mut by_key = Answered::default();
    let mut by_plan = Answered::default();
    let mut acknowledged: HashSet<String> = HashSet::new();
    history.each_submit(|event| {
        let planner = event["planner"].as_u64().unwrap_or(u64::MAX);
        // Every submit ends within its stated time (a little for the clock).
        if let (Some(took), Some(timeout)) = (event["took_s"].as_f64(), event["timeout_s"].as_f64())
            && took > timeout + 1.0
        {
            violations.push(format!(
                "a submit of {} took {took:.1} s, past its {timeout} s",
                event["key"]
            ));
        }
        // Every fault ends within about 20 s and a submit tries for 120:
        // an honest service answers every one of them.
        if let Some(error) = event["error"].as_str() {
            violations.push(format!(
                "planner {planner}'s {} of {} ({} to instance {}) was never acknowledged: {error}",
                event["why"], event["run_id"], event["key"], event["instance"]
            ));
            return;
        }
        let Some(receipt) = event["receipt_id"].as_str() else {
            violations.push(format!("an acknowledgement without a receipt: {event}"));
            return;
        };
        by_key.note(planner, event["key"].as_str().unwrap_or_default(), receipt);
        by_plan.note(
            planner,
            event["run_id"].as_str().unwrap_or_default(),
            receipt,
        );
        if let Some(sent) = event["request_hash"].as_str()
            && let Some(kept) = stored_hashes.get(receipt)
            && kept != sent
        {
            violations.push(format!(
                "receipt {receipt} was acknowledged for {sent}, but its plan is stored as {kept}"
            ));
        }
        if acknowledged.insert(receipt.to_owned()) {
            match stored.get(receipt) {
                Some(1) => {}
                Some(n) => violations.push(format!("receipt {receipt} is stored {n} times")),
                None => violations.push(format!("acknowledged receipt {receipt} is not stored")),
            }
        }
    })?;
    for ((planner, key), receipts) in &by_key.more {
        violations.push(format!(
            "planner {planner}'s key {key} answered {} receipts: {receipts:?}",
            receipts.len()
        ));
    }
    for ((planner, run), receipts) in &by_plan.more {
        violations.push(format!(
            "planner {planner}'s plan {run} has {} receipts: {receipts:?}",
            receipts.len()
        ));
    }
    // Other content under a used key: refused, never a receipt.
    for event in history.of_kind("conflict") {
        if let Some(receipt) = event["receipt_id"].as_str() {
            violations.push(format!(
                "key {} took other content ({}): answered {receipt}",
                event["key"], event["request_hash"]
            ));
        } else if event["refused"] != true {
            violations.push(format!(
                "key {} with other content was not refused: {}",
                event["key"], event["error"]
            ));
        }
    }
    // ...and nothing of it stored (its run ids end in `-changed`).
    let taken = system.query("SELECT receipt_id FROM plans WHERE run_id LIKE '%-changed'")?;
    if !taken.is_empty() {
        violations.push(format!(
            "{} plans sent as other content under a used key were stored: {taken:?}",
            taken.len()
        ));
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
    // The readers (processes, killed and started again): each handed on
    // the whole feed in its order, a page again only after a kill.
    for reader in &system.readers {
        let (handed, torn) = reader.handed_on();
        let kills = reader.kills.lock().map(|k| *k).unwrap_or(0);
        let mut seen = HashSet::new();
        let first: Vec<&String> = handed.iter().filter(|id| seen.insert(*id)).collect();
        let repeated = handed.len() - first.len();
        if first
            .iter()
            .map(|id| id.as_str())
            .ne(feed.iter().map(String::as_str))
        {
            let in_feed: HashSet<&String> = feed.iter().collect();
            let missing = feed.iter().filter(|id| !seen.contains(id)).count();
            let not_in_feed = first.iter().filter(|id| !in_feed.contains(*id)).count();
            violations.push(format!(
                "reader {} handed on {} receipts, the feed holds {}: {missing} missing, {not_in_feed} not in the feed{}",
                reader.name,
                first.len(),
                feed.len(),
                if missing + not_in_feed == 0 { ", out of order" } else { "" }
            ));
        }
        if reader.exactly_once && repeated > 0 {
            violations.push(format!(
                "reader {} kept {repeated} receipt(s) twice in its inbox, exactly once promised ({kills} kills)",
                reader.name
            ));
        }
        // A kill repeats at most the page in hand, right after it.
        let marks = reader
            .kill_marks
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default();
        if let Some(misplaced) = misplaced_repeat(&handed, &marks, page_limit()) {
            violations.push(format!(
                "reader {} handed receipts on again where no kill explains it ({repeated} again in all, {torn} torn lines, {kills} kills): {misplaced}",
                reader.name
            ));
        } else if torn > 0 && kills == 0 {
            violations.push(format!(
                "reader {} wrote {torn} torn lines without being killed",
                reader.name
            ));
        }
        if let Ok(exits) = reader.exits.lock() {
            violations.extend(exits.iter().cloned());
        }
    }
    // Every answer the instances logged: no 5xx but 503, and every 503
    // and 429 says when to come back.
    for panic in system.panics() {
        violations.push(format!("an instance panicked: {panic}"));
    }
    system.each_log_line(|line| {
        if line["message"] != "request" {
            // What the instances said besides their answers (warnings and
            // errors: what a violation's cause is looked for in), kept.
            let mut said = line.clone();
            said["kind"] = serde_json::json!("instance log");
            history.record_to_file(said);
            return;
        }
        let status = line["status"].as_u64().unwrap_or(0);
        let told = line["retry_after"].as_str().unwrap_or("-");
        if status >= 500 && status != 503 {
            violations.push(format!(
                "instance {} answered {status}: {line}",
                line["instance"]
            ));
        } else if (status == 503 || status == 429) && told == "-" {
            violations.push(format!(
                "instance {} answered {status} without Retry-After: {line}",
                line["instance"]
            ));
        }
        // Every answer, in the history too (kept after the run).
        let mut answer = line.clone();
        answer["kind"] = serde_json::json!("answer");
        history.record_to_file(answer);
    });
    for error in history.of_kind("follower-error") {
        violations.push(format!("the follower stopped: {}", error["error"]));
    }
    violations.extend(system.crashes());
    // The evidence holds at the end: the log recomputed from the tables
    // under the pinned keys, and the schema as shipped.
    let keys = system.keys.display().to_string();
    for args in [vec!["audit", "--keys", keys.as_str()], vec!["verify"]] {
        if let (code, said) = system.cli_status(&args)
            && code != Some(0)
        {
            violations.push(format!(
                "plan-intake {} at the end ended {code:?}: {said}",
                args.join(" ")
            ));
        }
    }
    for fault in history.of_kind("fault") {
        if let Some(error) = fault["error"].as_str() {
            violations.push(format!("after {}: {error}", fault["fault"]));
        }
    }
    Ok(violations)
}

/// The receipt each (planner, name) was answered first, and every
/// receipt of the names answered more than one.
#[derive(Default)]
struct Answered {
    first: HashMap<(u64, Box<str>), Box<str>>,
    more: HashMap<(u64, Box<str>), std::collections::BTreeSet<Box<str>>>,
}

impl Answered {
    fn note(&mut self, planner: u64, name: &str, receipt: &str) {
        let key = (planner, Box::<str>::from(name));
        match self.first.get(&key) {
            None => {
                self.first.insert(key, receipt.into());
            }
            Some(first) if **first == *receipt => {}
            Some(first) => {
                let first = first.clone();
                let all = self.more.entry(key).or_default();
                all.insert(first);
                all.insert(receipt.into());
            }
        }
    }
}

/// The most receipts a page holds (the followers' default limit).
fn page_limit() -> usize {
    plan_intake_client::FollowOptions::new("-").limit as usize
}

/// Where a reader's output repeats a receipt that no kill explains: after
/// each kill (its output then held `marks[k]` receipts) the receipts again
/// must come first and be at most one page; anywhere else none may.
fn misplaced_repeat(handed: &[String], kill_marks: &[usize], page: usize) -> Option<String> {
    let mut seen = HashSet::new();
    let mut repeats_may_start = 0usize;
    let mut in_repeat_run = false;
    let mut run_length = 0;
    let mut marks = kill_marks.iter().copied().peekable();
    for (at, id) in handed.iter().enumerate() {
        while marks.peek().is_some_and(|mark| *mark <= at) {
            repeats_may_start = marks.next().unwrap_or(at);
            in_repeat_run = true;
            run_length = 0;
        }
        let again = !seen.insert(id.as_str());
        if again {
            let at_a_kill = in_repeat_run && at == repeats_may_start + run_length;
            if !at_a_kill || run_length >= page {
                return Some(format!(
                    "{id} again at receipt {at} of its output (kills after receipts {kill_marks:?})"
                ));
            }
            run_length += 1;
        } else {
            in_repeat_run = false;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::misplaced_repeat;

    fn ids(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn a_page_again_is_allowed_only_right_after_a_kill() {
        // No kill: no repeat.
        assert!(misplaced_repeat(&ids("a b c b d"), &[], 100).is_some());
        // Killed after 3 receipts: b c again at once, then on.
        assert_eq!(misplaced_repeat(&ids("a b c b c d e"), &[3], 100), None);
        // ...but not later.
        assert!(misplaced_repeat(&ids("a b c d b e"), &[3], 100).is_some());
        // ...nor more than a page.
        assert!(misplaced_repeat(&ids("a b c a b c d"), &[3], 2).is_some());
        // Two kills, each followed by its page again.
        assert_eq!(
            misplaced_repeat(&ids("a b c c d e d e f"), &[3, 6], 100),
            None
        );
        // A kill with nothing again is fine.
        assert_eq!(misplaced_repeat(&ids("a b c d"), &[2], 100), None);
    }
}
