//! What a failed replay pass makes of a DLQ row: re-parked on the DLQ schedule, reclassified
//! as permanent after the same failure several passes in a row, or exhausted past the cap. A
//! pure function of the stored state and the failure, tested without a clock or a database.

use super::*;

pub(super) fn exhaust(row: &DlqRow, why: &str) -> Repark {
    Repark {
        id: row.id,
        generation: row.generation,
        content_hash: row.content_hash.clone(),
        error_class: row.error_class,
        error_reason: row.error_reason.clone(),
        last_error: row.last_error.clone(),
        last_status: row.last_status,
        attempts: 0,
        retry_in: None,
        exhausted_reason: Some(why.to_string()),
        signature: row.last_error_signature.clone(),
        same_error_count: row.same_error_count,
    }
}

/// The DLQ row's next state after a failed replay pass: a pure function of the stored state
/// and the failure, so it is tested without a clock or a database.
pub(crate) fn next_state(row: &DlqRow, f: &Failure, config: &ReplayConfig) -> Repark {
    let signature = format!("{}:{}", f.reason, f.status.unwrap_or(0));
    let same = if row.last_error_signature.as_deref() == Some(signature.as_str()) {
        row.same_error_count + 1
    } else {
        1
    };
    let passes = row.replays.saturating_add(1);
    let mut r = Repark {
        id: row.id,
        generation: row.generation,
        content_hash: row.content_hash.clone(),
        error_class: f.class,
        error_reason: f.reason.to_string(),
        last_error: Some(f.detail.clone()),
        last_status: f.status.map(i32::from),
        attempts: f.attempts as i32,
        retry_in: None,
        exhausted_reason: None,
        signature: Some(signature),
        same_error_count: same,
    };
    if f.class != ErrorClass::Transient {
        return r;
    }
    if f.reason == Reason::Http500 && same >= config.deterministic_failures {
        r.error_class = ErrorClass::PermanentInput;
        r.error_reason = Reason::RepeatedHttp500.as_str().into();
        return r;
    }
    if passes as u32 >= config.schedule.max_replays {
        r.exhausted_reason = Some(format!("replay limit reached after {passes} passes"));
        return r;
    }
    r.retry_in = Some(config.schedule.delay(passes as u32));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(replays: i32, sig: Option<&str>, same: i32) -> DlqRow {
        DlqRow {
            id: 1,
            target_table: "public.doc_embeddings".into(),
            doc_id: "d".into(),
            chunk_index: 0,
            content_hash: "h".into(),
            model: Some("m".into()),
            request_dimensions: None,
            text: "t".into(),
            replays,
            generation: 7,
            attempts: 5,
            error_class: ErrorClass::Transient,
            error_reason: "http_503".into(),
            last_error: None,
            last_status: Some(503),
            exhausted: false,
            last_error_signature: sig.map(str::to_string),
            same_error_count: same,
            manifest_hash: Some("h".into()),
            loads: 1,
        }
    }

    fn failure(reason: Reason, status: u16, class: ErrorClass) -> Failure {
        Failure { class, reason, detail: "x".into(), status: Some(status), attempts: 3 }
    }

    #[test]
    fn transient_failure_is_rescheduled_on_the_dlq_schedule() {
        let cfg = ReplayConfig::default();
        let r = next_state(&row(0, None, 0), &failure(Reason::Http503, 503, ErrorClass::Transient), &cfg);
        assert_eq!(r.error_class, ErrorClass::Transient);
        assert!(r.retry_in.unwrap() >= cfg.schedule.base);
        assert_eq!(r.exhausted_reason, None);
        assert_eq!(r.same_error_count, 1);
        assert_eq!(r.attempts, 3);
    }

    #[test]
    fn repeated_500_becomes_permanent_before_the_cap() {
        let cfg = ReplayConfig::default();
        let f = failure(Reason::Http500, 500, ErrorClass::Transient);
        let r = next_state(&row(1, Some("http_500:500"), 1), &f, &cfg);
        assert_eq!(r.error_class, ErrorClass::Transient, "two in a row is not yet a pattern");
        let r = next_state(&row(2, Some("http_500:500"), 2), &f, &cfg);
        assert_eq!(r.error_class, ErrorClass::PermanentInput);
        assert_eq!(r.error_reason, "repeated_http_500");
        assert_eq!(r.retry_in, None);
    }

    #[test]
    fn replay_limit_exhausts_and_permanent_classes_are_not_rescheduled() {
        let cfg = ReplayConfig::default();
        let last = cfg.schedule.max_replays as i32 - 1;
        let r = next_state(&row(last, None, 0), &failure(Reason::Timeout, 0, ErrorClass::Transient), &cfg);
        assert!(r.exhausted_reason.is_some());
        assert_eq!(r.retry_in, None);
        let r =
            next_state(&row(0, None, 0), &failure(Reason::Http400, 400, ErrorClass::PermanentInput), &cfg);
        assert_eq!(r.error_class, ErrorClass::PermanentInput);
        assert_eq!(r.retry_in, None);
        assert_eq!(r.exhausted_reason, None);
    }
}
