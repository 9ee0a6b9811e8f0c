//! The Grafana dashboard (`grafana/embed-dlq.json`): every PromQL expression in it is valid
//! (they are written into a rules file as recording rules and `promtool check rules` must
//! accept it), every metric name it uses appears in a real scrape of `serve`, every metric
//! family the exporter serves has a panel, and every alert of `prometheus/alerts.yml` is
//! drawn as a threshold line.

use std::collections::BTreeSet;

use crate::support::*;

fn dashboard() -> serde_json::Value {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/grafana/embed-dlq.json")).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel, rows' nested panels included.
fn panels(d: &serde_json::Value) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p.clone());
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested.iter().cloned());
        }
    }
    out
}

/// Every query expression: panel targets and the template variables' queries (as the
/// selector inside `label_values(...)`).
fn expressions(d: &serde_json::Value) -> Vec<String> {
    let mut exprs: Vec<String> = panels(d)
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("every target has an expr").to_string())
        .collect();
    for v in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|q| q.split(',').next())
                .expect("label_values query");
            exprs.push(inner.trim().to_string());
        }
    }
    exprs
}

/// The expression as Prometheus would receive it from Grafana (variables replaced).
fn interpolate(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "30s")
        .replace("$__range", "1h")
        .replace("$job", ".*")
        .replace("$shard", ".*")
}

fn metric_names(exprs: &[String]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for e in exprs {
        let mut rest = e.as_str();
        while let Some(at) = rest.find("embed_dlq_") {
            let name: String =
                rest[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            rest = &rest[at + name.len()..];
            names.insert(name);
        }
    }
    names
}

#[test]
fn every_expression_passes_promtool() {
    let exprs = expressions(&dashboard());
    assert!(exprs.len() >= 30, "{} expressions", exprs.len());
    let rules: Vec<serde_json::Value> = exprs
        .iter()
        .enumerate()
        .map(|(i, e)| serde_json::json!({"record": format!("dashboard:expr_{i}"), "expr": interpolate(e)}))
        .collect();
    // JSON is YAML: promtool reads this as a rules file.
    let file = std::env::temp_dir().join(format!("it-dashboard-rules-{}.yml", std::process::id()));
    std::fs::write(&file, serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]}).to_string())
        .unwrap();
    let out = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .expect("promtool (scripts/test.sh installs Debian's prometheus package)");
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_alert_is_a_threshold_line() {
    let d = dashboard();
    let alerts =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/prometheus/alerts.yml")).unwrap();
    let names: Vec<&str> = alerts.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert_eq!(names.len(), 7, "{names:?}");
    for name in names {
        let panel = panels(&d)
            .into_iter()
            .find(|p| p["description"].as_str().is_some_and(|s| s.contains(&format!("alert {name} "))))
            .unwrap_or_else(|| panic!("no panel draws alert {name}"));
        let defaults = &panel["fieldConfig"]["defaults"];
        let steps = defaults["thresholds"]["steps"].as_array().unwrap();
        assert!(steps.iter().any(|s| s["value"].is_number()), "{name}: no threshold value");
        assert_ne!(defaults["custom"]["thresholdsStyle"]["mode"], "off", "{name}: thresholds not drawn");
        // The alert's expression reads the metric the panel shows.
        let panel_metrics = metric_names(&[panel["targets"].to_string()]);
        let alert_block = alerts.split("- alert: ").find(|b| b.starts_with(name)).unwrap();
        assert!(
            metric_names(&[alert_block.to_string()]).iter().any(|m| panel_metrics.contains(m)),
            "{name}: the panel does not show the alert's metric"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_it_uses_is_in_a_real_scrape_and_every_family_has_a_panel() {
    let d = dashboard();
    let used = metric_names(&expressions(&d));
    let db = TestDb::new().await;
    let exported = |text: &str| -> BTreeSet<String> {
        text.lines()
            .filter(|l| l.starts_with("embed_dlq_"))
            .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
            .collect()
    };
    // A target with revisions, so that the revision gauges are sampled.
    embed_dlq::store::revision::create_shadow(
        &db.pool,
        "doc_embeddings",
        Some("mock"),
        "mock-next",
        256,
        Some(256),
    )
    .await
    .unwrap();
    // A table source, so that its lag gauges are sampled.
    sqlx::raw_sql("CREATE TABLE notes (id int PRIMARY KEY, body text)").execute(&db.pool).await.unwrap();
    let spec = embed_dlq::store::table_source::TableSourceSpec {
        name: "notes".into(),
        table: "notes".into(),
        key_column: "id".into(),
        chunk_column: None,
        template: "{body}".into(),
        metadata_columns: vec![],
        target_table: "doc_embeddings".into(),
        chunking: None,
    };
    embed_dlq::store::table_source::add_table(&db.pool, &spec).await.unwrap();
    let body = scrape_serve_until(&db, |text| used.iter().all(|m| exported(text).contains(m))).await;
    let scraped = exported(&body);
    let missing: Vec<_> = used.iter().filter(|m| !scraped.contains(*m)).collect();
    assert!(missing.is_empty(), "used by the dashboard, not in the scrape: {missing:?}\n{body}");
    // Every family of the scrape has a panel (a histogram through its buckets).
    let families: BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(|f| f.to_string())
        .collect();
    for family in &families {
        let shown = used.contains(family) || used.contains(&format!("{family}_bucket"));
        assert!(shown, "metric family {family} has no panel");
    }
    assert!(families.len() >= 30, "{families:?}");
}
