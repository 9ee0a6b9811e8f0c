//! The operator console in a real browser: Debian's headless Chromium driven through
//! chromedriver (WebDriver, `webdriver.rs`), against a console served in-process over a real
//! test database and the real Redis (streams under a prefix of the test's own).
//!
//! What the browser tests prove:
//! - `browse_filter_open_requeue_and_tail`: the overview loads with the DLQ's numbers; the
//!   list's filter narrows it to one class (the count and every row agree with Postgres); a
//!   row opens with its payload and history; after logging in, requeueing the filter's rows
//!   through the dry run and the confirmation makes exactly those rows due again as replay
//!   work (checked in Postgres) and writes one audit entry; the live tail shows the events
//!   of that requeue as they are relayed (Server-Sent Events); the reconcile page finds a
//!   vector deleted behind the manifest's back, shows the repair's dry run, repairs it, and
//!   the next check is clean.
//! - `actions_without_the_token_are_refused_and_change_nothing`: without a session the
//!   confirmation form is not offered, and a forged form is refused; a logged-in browser
//!   with a wrong CSRF token is refused too; a read-only console shows no action and refuses
//!   them all; Postgres is unchanged and no action is in the audit trail. A login whose
//!   `next` is `/<TAB>/<another origin>/` lands on the console's own `/`.
//! - `no_injected_script_runs`: a `<script>` in a doc id, a text, metadata and a provider's
//!   error message is shown as text on every page and never runs (the raw HTML is escaped;
//!   the browser's `window.__pwned` stays undefined and its title unchanged).
//!
//!
//! Without a browser: the live tail resumes exactly after `Last-Event-ID` and refuses
//! clients beyond its bound; `serve --console-addr` serves the console with its own breaker
//! and stops with it; console settings outside their bounds are usage errors (exit 2); a
//! login's `next` with a tab, a line break, a NUL or `//` returns to `/` (never a 500);
//! beyond loopback every page needs a session unless `--public-read`; a 24 MB row's page is
//! bounded and links its streamed download, and views beyond `--max-row-views` get 503; the
//! session cookie is `Secure` beyond loopback or when asked.
//!
//! Screenshots of every page go to `target/test-output/console/`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use embed_dlq::console::{Console, ConsoleConfig, ConsoleToken};
use embed_dlq::streams::StreamKeys;
use embed_dlq::testkit::mock_provider::{MockConfig, POISON_400, POISON_DIM};
use tokio_util::sync::CancellationToken;

use crate::support::*;
use crate::webdriver::{Element, Session};

const TOKEN: &str = "test-console-token-0123456789";
/// Generous: the machine running the suite may be loaded.
const WAIT: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------------------------------
// The browser
// ---------------------------------------------------------------------------------------

/// A headless Chromium behind a chromedriver of its own (its own process group, killed on
/// drop with everything it started, also when the test panics).
struct Browser {
    client: Option<Session>,
    driver: std::process::Child,
    profile: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Browser {
    async fn start() -> Browser {
        use std::os::unix::process::CommandExt;
        let chromedriver = which("chromedriver")
            .expect("chromedriver is missing: scripts/test.sh installs Debian's chromium-driver (scripts/ensure-chromium.sh)");
        let port = free_port();
        let driver = std::process::Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start chromedriver");
        let profile = std::env::temp_dir().join(format!("it-console-chromium-{}-{port}", std::process::id()));
        let mut browser = Browser { client: None, driver, profile };
        let url = format!("http://127.0.0.1:{port}");
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Ok(r) =
                embed_dlq::http::client_builder().build().unwrap().get(format!("{url}/status")).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "chromedriver did not come up");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let chrome_options = serde_json::json!({
            "binary": which("chromium").expect("chromium is missing: scripts/ensure-chromium.sh installs it"),
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--disable-quic", "--no-first-run", "--window-size=1360,1000",
                format!("--user-data-dir={}", browser.profile.display()),
            ],
        });
        let client = Session::start(&url, chrome_options, Duration::from_secs(60), Duration::from_secs(90))
            .await
            .unwrap_or_else(|e| panic!("a WebDriver session: {e}"));
        browser.client = Some(client);
        browser
    }

    fn c(&self) -> &Session {
        self.client.as_ref().unwrap()
    }

    async fn goto(&self, url: &str) {
        self.c().goto(url).await.unwrap_or_else(|e| panic!("load {url}: {e}"));
    }

    async fn wait(&self, css: &str) -> Element<'_> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match self.c().find(css).await {
                Ok(found) => return found,
                Err(e) => assert!(tokio::time::Instant::now() < deadline, "no {css} on the page: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn text(&self, css: &str) -> String {
        self.wait(css).await.text().await.unwrap()
    }

    async fn exists(&self, css: &str) -> bool {
        self.c().find(css).await.is_ok()
    }

    /// Waits until `css`'s text satisfies `ok` (pages that update themselves).
    async fn wait_text(&self, css: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Ok(e) = self.c().find(css).await
                && let Ok(t) = e.text().await
                && ok(&t)
            {
                return t;
            }
            assert!(tokio::time::Instant::now() < deadline, "{css} never showed the expected text");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn shot(&self, name: &str) {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-output/console"));
        std::fs::create_dir_all(&dir).unwrap();
        let png = self.c().screenshot().await.unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }

    /// `[typeof window.__pwned, document.title]`.
    async fn pwned(&self) -> (String, String) {
        let v = self.c().execute("return [typeof window.__pwned, document.title];", vec![]).await.unwrap();
        (v[0].as_str().unwrap().to_string(), v[1].as_str().unwrap().to_string())
    }

    async fn login(&self, base: &str, next: &str) {
        self.goto(&format!("{base}/login?next={}", next.replace('&', "%26").replace('?', "%3F"))).await;
        self.wait("#login-name").await.send_keys("ci-operator").await.unwrap();
        self.wait("#login-token").await.send_keys(TOKEN).await.unwrap();
        self.wait("#login-button").await.click().await.unwrap();
        self.wait_text(".who", |t| t.contains("ci-operator")).await;
    }

    /// Logs in through the form after setting its hidden `next` to `raw` (what a page on
    /// another site could post), and returns the URL the browser lands on.
    async fn login_with_next(&self, base: &str, raw: &str) -> String {
        self.goto(&format!("{base}/login")).await;
        self.wait("#login-name").await.send_keys("ci-operator").await.unwrap();
        self.wait("#login-token").await.send_keys(TOKEN).await.unwrap();
        self.c()
            .execute(
                "document.querySelector('#login input[name=next]').value = arguments[0];",
                vec![raw.into()],
            )
            .await
            .unwrap();
        self.wait("#login-button").await.click().await.unwrap();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let url = self.c().current_url().await.unwrap().to_string();
            if !url.ends_with("/login") {
                return url;
            }
            assert!(tokio::time::Instant::now() < deadline, "the login never left its page ({url})");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn close(mut self) {
        if let Some(c) = self.client.take() {
            let _ = c.close().await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver and the browsers it started share its process group.
        let _ = std::process::Command::new("kill")
            .args(["-9", "--", &format!("-{}", self.driver.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Another origin (`127.0.0.1:<port>`) that answers every request with a small page, for
/// as long as the test runs: where an open redirect would land.
async fn other_origin() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = sock.read(&mut buf).await;
                let body = "<html><head><title>elsewhere</title></head><body>elsewhere</body></html>";
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(format!("{head}{body}").as_bytes()).await;
            });
        }
    });
    addr.to_string()
}

fn which(name: &str) -> Option<String> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
}

// ---------------------------------------------------------------------------------------
// The console under test
// ---------------------------------------------------------------------------------------

struct Served {
    base: String,
    cancel: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Served {
    async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle).await.expect("the console stops").unwrap();
    }
}

async fn serve_console(db: &TestDb, keys: &StreamKeys, read_only: bool) -> Served {
    let store = embed_dlq::store::Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let console = Console {
        store,
        redis: Some(redis_client()),
        keys: keys.clone(),
        gate: None,
        config: ConsoleConfig {
            listen: addr,
            read_only,
            token: Some(ConsoleToken::new(TOKEN.into()).unwrap()),
            ..Default::default()
        },
    };
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let handle = tokio::spawn(async move {
        embed_dlq::console::serve_on(listener, console, stop).await.expect("console serves");
    });
    Served { base: format!("http://{addr}"), cancel, handle }
}

/// Ingests `lines` against the mock (`mock` settings), then relays every event to `keys`.
async fn seed(db: &TestDb, keys: &StreamKeys, mock: MockConfig, lines: &[String]) {
    let mock = start_mock(mock).await;
    let s = settings(db, &mock);
    let corpus: String = lines.concat();
    pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    relay_all(db, keys).await;
}

/// A corpus with clean chunks, rows the provider rejects (`permanent_input`) and rows with
/// vectors of the wrong size (`dimension_mismatch`).
fn mixed_corpus() -> Vec<String> {
    let mut lines = Vec::new();
    for i in 0..20 {
        lines.push(line(&format!("clean-{i}"), 0, &format!("clean text {i}")));
    }
    for i in 0..5 {
        lines.push(line(&format!("alpha-{i}"), 0, &format!("{POISON_400} alpha {i}")));
    }
    for i in 0..3 {
        lines.push(line(&format!("beta-{i}"), 0, &format!("{POISON_DIM} beta {i}")));
    }
    lines
}

async fn ids_of_class(db: &TestDb, class: &str) -> Vec<i64> {
    sqlx::query_scalar("SELECT id FROM embedding_dlq WHERE error_class = $1 ORDER BY id")
        .bind(class)
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// The DLQ's rows as text, to compare before and after a refused action.
async fn dlq_snapshot(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT concat_ws('|', id, error_class, error_reason, generation, next_retry_at, exhausted_at)
           FROM embedding_dlq ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browse_filter_open_requeue_and_tail() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    seed(&db, &keys, MockConfig::default(), &mixed_corpus()).await;
    let permanent = ids_of_class(&db, "permanent_input").await;
    let dims = ids_of_class(&db, "dimension_mismatch").await;
    assert_eq!((permanent.len(), dims.len()), (5, 3), "the corpus parks 5 + 3 rows");
    let served = serve_console(&db, &keys, false).await;
    let base = served.base.clone();
    let b = Browser::start().await;

    // The overview.
    b.goto(&format!("{base}/")).await;
    assert_eq!(b.text("#dlq-total").await, "8");
    assert!(b.text("#by-class").await.contains("permanent_input"));
    assert!(b.text("#streams").await.contains(&keys.events()));
    b.shot("overview").await;

    // The list, filtered to one class through the form.
    b.goto(&format!("{base}/dlq")).await;
    assert_eq!(b.text("#match-count").await, "8");
    b.wait("select[name=class]").await.select_by_value("permanent_input").await.unwrap();
    b.wait("#apply").await.click().await.unwrap();
    b.wait_text(".summary", |t| t.contains("class permanent_input")).await;
    assert_eq!(b.text("#match-count").await, permanent.len().to_string());
    let rows = b.c().find_all("#rows tbody tr").await.unwrap();
    assert_eq!(rows.len(), permanent.len());
    for r in &rows {
        assert!(r.text().await.unwrap().contains("permanent_input"));
    }
    b.shot("list-filtered").await;

    // Open a row.
    b.wait("a.row-link").await.click().await.unwrap();
    let text = b.text("#payload-text").await;
    assert!(text.contains("alpha"), "{text}");
    assert!(b.text("#timeline").await.contains("ingest"));
    b.wait("#row-events").await;
    b.shot("detail").await;

    // Requeue the filter's rows: log in, dry run, confirm, result.
    let since: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now()").fetch_one(&db.pool).await.unwrap();
    b.login(&base, "/dlq?class=permanent_input").await;
    b.wait("#bulk-requeue").await.click().await.unwrap();
    assert_eq!(b.text("#would-count").await, permanent.len().to_string());
    b.shot("requeue-dry-run").await;
    b.wait("#confirm-button").await.click().await.unwrap();
    b.wait_text("#status", |t| t == "done").await;
    assert_eq!(b.text("#done-count").await, permanent.len().to_string());
    b.shot("requeue-result").await;
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM embedding_dlq
          WHERE id = ANY($1) AND error_class = 'transient' AND exhausted_at IS NULL
            AND error_reason LIKE 'requeued:permanent_input/%' AND next_retry_at >= $2",
    )
    .bind(&permanent)
    .bind(since)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(due, permanent.len() as i64, "every filtered row is due again as replay work");
    // A serve's scheduler issues their work at its next pass.
    let store = pipeline(&settings(&db, &start_mock(MockConfig::default()).await)).await.store;
    let scheduler = embed_dlq::replay::Scheduler::new(store, Default::default(), redis().await, keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), permanent.len() as u64);
    let (items, _) = replay_entries(&keys).await;
    let work: std::collections::BTreeSet<i64> =
        items.iter().filter_map(|b| b["dlq_id"].as_i64()).filter(|id| permanent.contains(id)).collect();
    assert_eq!(work.len(), permanent.len(), "a replay work item per row, on the replay stream");
    let untouched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM embedding_dlq WHERE id = ANY($1) AND error_class = 'dimension_mismatch'",
    )
    .bind(&dims)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(untouched, dims.len() as i64, "rows outside the filter are left alone");
    let audit: (String, String, i64, String) = sqlx::query_as(
        "SELECT actor, action, count, filter->>'class' FROM console_audit WHERE action = 'requeue'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        audit,
        ("ci-operator".into(), "requeue".into(), permanent.len() as i64, "permanent_input".into())
    );

    // The live tail: the requeue's events arrive once the relay publishes them.
    b.goto(&format!("{base}/events")).await;
    b.wait_text("#events-status", |t| t == "live").await;
    relay_all(&db, &keys).await;
    b.wait("#events-body tr.live").await;
    b.wait_text("#events-body", |t| t.contains("requeued")).await;
    b.shot("events").await;

    // Reconcile: a vector lost behind the manifest's back is found by the checks, shown by
    // the repair's dry run, repaired, and the next check is clean.
    sqlx::query("DELETE FROM doc_embeddings WHERE doc_id = 'clean-0'").execute(&db.pool).await.unwrap();
    b.goto(&format!("{base}/reconcile")).await;
    b.wait("#run-check").await.click().await.unwrap();
    b.wait_text("#report-summary", |t| t.contains("findings")).await;
    assert!(b.text("#report").await.contains("stored_drift"));
    b.wait("#run-dry-run").await.click().await.unwrap();
    b.wait_text("h2", |t| t == "This run: repair dry run").await;
    b.shot("reconcile-dry-run").await;
    b.wait("#run-repair").await.click().await.unwrap();
    b.wait_text("h2", |t| t == "This run: repair").await;
    b.shot("reconcile-repair").await;
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'clean-0' AND status = 'reingest'")
            .await,
        1,
        "the repair marked the chunk for re-ingest"
    );
    b.wait("#run-check").await.click().await.unwrap();
    b.wait_text("#report-summary", |t| t.contains("clean")).await;
    b.shot("reconcile").await;
    assert_eq!(
        db.count("SELECT count(*) FROM console_audit WHERE action LIKE 'reconcile_%' AND status = 'done'")
            .await,
        4
    );
    b.goto(&format!("{base}/audit")).await;
    b.shot("audit").await;

    b.close().await;
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_without_the_token_are_refused_and_change_nothing() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    seed(&db, &keys, MockConfig::default(), &mixed_corpus()).await;
    let before = dlq_snapshot(&db).await;
    let served = serve_console(&db, &keys, false).await;
    let base = served.base.clone();
    let b = Browser::start().await;

    // Without a session: the dry run shows, the confirmation does not.
    b.goto(&format!("{base}/actions/purge?class=permanent_input")).await;
    assert_eq!(b.text("#would-count").await, "5");
    b.wait("#login-to-act").await;
    assert!(!b.exists("#confirm").await, "no confirmation form without a session");
    b.shot("refused-no-session-dry-run").await;

    // A forged form (what a script or another page could post) is refused.
    let forge = "const [action, csrf] = arguments;
        const f = document.createElement('form');
        f.method = 'post'; f.action = action;
        for (const [k, v] of [['class', 'permanent_input'], ['max_id', '1000000'], ['matched', '5'],
                              ['confirm', 'purge'], ['csrf', csrf]]) {
            const i = document.createElement('input'); i.type = 'hidden'; i.name = k; i.value = v; f.appendChild(i);
        }
        document.body.appendChild(f); f.submit();";
    b.c().execute(forge, vec!["/actions/purge".into(), "".into()]).await.unwrap();
    let refused = b.text("#message").await;
    assert!(refused.contains("log in"), "{refused}");
    b.shot("refused-no-session").await;

    // A login told to return to `/<TAB>/<another origin>/` (Chromium strips the tab and
    // would go there) stays on this console.
    let evil = other_origin().await;
    let landed = b.login_with_next(&base, &format!("/\t/{evil}/")).await;
    assert_eq!(landed, format!("{base}/"), "the login left the console's origin");
    b.wait_text(".who", |t| t.contains("ci-operator")).await;

    // Logged in, but with a forged CSRF token: refused as well.
    for action in ["/actions/purge", "/actions/requeue", "/reconcile"] {
        b.goto(&format!("{base}/dlq")).await;
        b.wait("#match-count").await;
        b.c().execute(forge, vec![action.into(), "forged-csrf-token".into()]).await.unwrap();
        let refused = b.text("#message").await;
        assert!(refused.contains("security token"), "{action}: {refused}");
    }
    b.shot("refused-forged-csrf").await;

    // Straight HTTP without a cookie: 401, for every mutating route.
    let http = embed_dlq::http::client_builder().build().unwrap();
    for (path, body) in [
        ("/actions/purge", "class=permanent_input&max_id=1000000&confirm=purge&csrf=x"),
        ("/actions/requeue", "class=permanent_input&max_id=1000000&csrf=x"),
        ("/reconcile", "mode=repair&csrf=x"),
        ("/logout", "csrf=x"),
    ] {
        let r = http
            .post(format!("{base}{path}"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
    }
    // A wrong token does not log in.
    let r = http
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("token=wrong-token-wrong-token&name=mallory")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.headers().get("set-cookie").is_none());

    // A read-only console offers no action and refuses them.
    let ro = serve_console(&db, &keys, true).await;
    b.goto(&format!("{}/dlq", ro.base)).await;
    b.wait("#match-count").await;
    assert!(!b.exists("#bulk-requeue").await && !b.exists("#bulk-purge").await);
    assert!(b.text(".who").await.contains("read-only"));
    b.shot("read-only").await;
    let r = http
        .post(format!("{}/actions/requeue", ro.base))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("class=permanent_input&max_id=1000000&csrf=x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);

    assert_eq!(dlq_snapshot(&db).await, before, "nothing changed");
    assert_eq!(
        db.count("SELECT count(*) FROM console_audit WHERE action NOT IN ('login', 'logout')").await,
        0,
        "no action was taken"
    );
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event IN ('purged', 'requeued')").await, 0);

    b.close().await;
    ro.stop().await;
    served.stop().await;
}

/// A script that marks the page if it ever runs.
const HOSTILE: &str = "<script>window.__pwned=1;document.title='pwned'</script>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_injected_script_runs() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let img = "<img src=x onerror=\"window.__pwned=3;document.title='pwned'\">";
    let mut lines = vec![line("clean", 0, "a clean text")];
    // In the doc id and the text (rejected by the provider, so parked with its payload).
    lines.push(line(HOSTILE, 0, &format!("{POISON_400} {HOSTILE}")));
    // In the metadata.
    lines.push(format!(
        "{}\n",
        serde_json::json!({"doc_id": "meta-doc", "chunk_index": 0, "text": format!("{POISON_400} meta"),
                           "metadata": {"note": img, "html": HOSTILE}})
    ));
    // In the provider's error message: an over-long input is answered 422 echoing it.
    lines.push(line("echo-doc", 0, &format!("{HOSTILE} {img} {}", "x".repeat(200))));
    seed(&db, &keys, MockConfig { max_input_chars: 150, ..MockConfig::default() }, &lines).await;
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM embedding_dlq ORDER BY id").fetch_all(&db.pool).await.unwrap();
    assert_eq!(ids.len(), 3, "three hostile rows parked");
    let id_of = async |doc: &str| -> i64 {
        sqlx::query_scalar("SELECT id FROM embedding_dlq WHERE doc_id = $1")
            .bind(doc)
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let (script_row, meta_row, echo_row) =
        (id_of(HOSTILE).await, id_of("meta-doc").await, id_of("echo-doc").await);
    let echoed: i64 = db.count("SELECT count(*) FROM embedding_dlq WHERE last_error LIKE '%<script>%'").await;
    assert_eq!(echoed, 1, "the provider's error message carries the script");

    let served = serve_console(&db, &keys, false).await;
    let base = served.base.clone();
    let prefix = form_urlencoded::byte_serialize(HOSTILE.as_bytes()).collect::<String>();
    let mut pages = vec![
        "/".to_string(),
        "/dlq".to_string(),
        format!("/dlq?doc_prefix={prefix}"),
        format!("/actions/requeue?doc_prefix={prefix}"),
        "/events".to_string(),
        "/audit".to_string(),
        format!("/login?next=/{prefix}"),
        format!("/nope/{prefix}"),
    ];
    pages.extend(ids.iter().map(|id| format!("/dlq/{id}")));

    // The HTML itself: every hostile string is escaped.
    let http = embed_dlq::http::client_builder().build().unwrap();
    for p in &pages {
        let body = http.get(format!("{base}{p}")).send().await.unwrap().text().await.unwrap();
        assert!(!body.contains("<script>window"), "{p} has a raw script:\n{body}");
        assert!(!body.contains("<img src=x"), "{p} has a raw img:\n{body}");
    }

    // In the browser: shown as text, never run.
    let b = Browser::start().await;
    for p in &pages {
        b.goto(&format!("{base}{p}")).await;
        b.wait("main").await;
        if p == "/events" {
            b.wait_text("#events-status", |t| t == "live").await;
        }
        let (pwned, title) = b.pwned().await;
        assert_eq!(pwned, "undefined", "{p}: a script ran");
        assert!(!title.contains("pwned"), "{p}: a script ran ({title})");
    }
    b.goto(&format!("{base}/dlq/{script_row}")).await;
    assert_eq!(b.text("#doc-id").await, HOSTILE, "the doc id is shown as text");
    assert!(b.text("#payload-text").await.contains(HOSTILE));
    b.shot("hostile-detail").await;
    b.goto(&format!("{base}/dlq/{meta_row}")).await;
    assert!(b.text("#payload-metadata").await.contains("onerror"));
    b.goto(&format!("{base}/dlq/{echo_row}")).await;
    assert!(b.text("#last-error").await.contains("<script>"));
    b.shot("hostile-error").await;
    b.goto(&format!("{base}/events")).await;
    b.wait_text("#events-body", |t| t.contains(HOSTILE)).await;
    b.shot("hostile-events").await;
    let (pwned, title) = b.pwned().await;
    assert_eq!(pwned, "undefined");
    assert!(!title.contains("pwned"), "{title}");

    b.close().await;
    served.stop().await;
}

// ---------------------------------------------------------------------------------------
// Without a browser: the live tail's protocol, `serve --console-addr`, the settings
// ---------------------------------------------------------------------------------------

/// Reads Server-Sent Events from `resp` until `n` `dlq` events arrived; returns their ids.
async fn read_events(resp: &mut reqwest::Response, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut buf = String::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while ids.len() < n {
        let chunk = tokio::time::timeout_at(deadline, resp.chunk()).await.expect("events in time").unwrap();
        buf.push_str(&String::from_utf8_lossy(&chunk.expect("the stream stays open")));
        while let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            if frame.lines().any(|l| l == "event: dlq") {
                let id = frame.lines().find_map(|l| l.strip_prefix("id: ")).expect("every event has an id");
                // The SSE id is the tail position: the entry id, then (when known) the
                // stream's count at it.
                let entry = id.split(' ').next().unwrap_or_default();
                ids.push(entry.to_string());
            }
        }
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_tail_resumes_after_last_event_id_and_is_bounded() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    seed(&db, &keys, MockConfig::default(), &mixed_corpus()).await;
    let all: Vec<String> = {
        let mut redis = redis().await;
        let reply: redis::streams::StreamRangeReply =
            redis::cmd("XRANGE").arg(keys.events()).arg("-").arg("+").query_async(&mut redis).await.unwrap();
        reply.ids.into_iter().map(|e| e.id).collect()
    };
    assert_eq!(all.len(), 8, "one parked event per row");
    let store = embed_dlq::store::Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let console = Console {
        store,
        redis: Some(redis_client()),
        keys: keys.clone(),
        gate: None,
        config: ConsoleConfig { listen: addr, max_event_clients: 2, ..Default::default() },
    };
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let handle =
        tokio::spawn(async move { embed_dlq::console::serve_on(listener, console, stop).await.unwrap() });
    let url = format!("http://{addr}/events/stream");
    let http = embed_dlq::http::client_builder().build().unwrap();

    // A browser that reconnects after the third event gets exactly the rest, in order.
    let mut resumed = http.get(&url).header("last-event-id", &all[2]).send().await.unwrap();
    assert_eq!(resumed.status().as_u16(), 200);
    assert_eq!(resumed.headers()["content-type"], "text/event-stream");
    assert_eq!(read_events(&mut resumed, 5).await, all[3..].to_vec());
    // A bad id is refused rather than passed to Redis.
    let bad = http.get(&url).header("last-event-id", "now").send().await.unwrap();
    assert_eq!(bad.status().as_u16(), 400);
    // Two clients at most: the third is told to come back.
    let mut second = http.get(format!("{url}?from=0")).send().await.unwrap();
    assert_eq!(read_events(&mut second, 8).await, all);
    let third = http.get(&url).send().await.unwrap();
    assert_eq!(third.status().as_u16(), 503);
    // A client that leaves frees its slot.
    drop(second);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let r = http.get(&url).send().await.unwrap();
        if r.status().as_u16() == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the slot was never freed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Stopping the console ends the open tails.
    drop(resumed);
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("the console stops with tails open")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_mounts_the_console_with_its_own_breaker() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    seed(&db, &keys, MockConfig::default(), &mixed_corpus()).await;
    let mock = start_mock(MockConfig::default()).await;
    let port = free_port();
    let prefix = keys.events().trim_start_matches('{').split('}').next().unwrap().to_string();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
        .arg("serve")
        .args(["--database-url", &db.url, "--redis-url", &redis_url(), "--base-url", &mock.base_url()])
        .args(["--stream-prefix", &prefix, "--replayers", "1"])
        .args(["--console-addr", &format!("127.0.0.1:{port}"), "--console-read-only"])
        .env("EMBED_DLQ_CONSOLE_TOKEN", TOKEN)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/");
    let deadline = tokio::time::Instant::now() + WAIT;
    let body = loop {
        if let Ok(r) = embed_dlq::http::client_builder().build().unwrap().get(&url).send().await
            && r.status().is_success()
        {
            break r.text().await.unwrap();
        }
        assert!(tokio::time::Instant::now() < deadline, "serve never served the console");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(body.contains("this process (serve)"), "{body}");
    assert!(body.contains("breaker-closed"), "{body}");
    assert!(body.contains("read-only"), "{body}");
    assert!(
        !body.contains(&db.url) && !body.contains(&redis_url()) && !body.contains(TOKEN),
        "no secret rendered"
    );
    let r = embed_dlq::http::client_builder()
        .build()
        .unwrap()
        .post(format!("http://127.0.0.1:{port}/actions/purge"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("max_id=1&confirm=purge&csrf=x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403, "read-only inside serve too");
    // SIGTERM stops serve and its console together, cleanly.
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = tokio::time::timeout(WAIT, child.wait()).await.expect("serve stops").unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn console_settings_out_of_their_bounds_are_usage_errors() {
    let db = TestDb::new().await;
    let run = async |args: &[&str], token: &str| {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
            .arg("console")
            // An address of no interface here (TEST-NET-1): binding it fails.
            .args(["--database-url", &db.url, "--listen", "192.0.2.1:8088"])
            .args(args)
            .env("EMBED_DLQ_CONSOLE_TOKEN", token)
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (code, err) = run(&[], "short").await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("EMBED_DLQ_CONSOLE_TOKEN") && !err.contains("short\""), "{err}");
    let (code, err) = run(&["--requeue-rate", "0"], TOKEN).await;
    assert_eq!(code, Some(2), "{err}");
    let (code, err) = run(&["--max-event-clients", "65"], TOKEN).await;
    assert_eq!(code, Some(2), "{err}");
    let (code, err) = run(&["--metrics-url", "ftp://user:secret@host/metrics"], TOKEN).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--metrics-url") && !err.contains("secret"), "{err}");
    let (code, err) = run(&["--allow-host", "evil host"], TOKEN).await;
    assert_eq!(code, Some(2), "{err}");
    for huge in ["0", "601", "18446744073709551616"] {
        let (code, err) = run(&["--page-timeout-secs", huge], TOKEN).await;
        assert_eq!(code, Some(2), "--page-timeout-secs {huge}: {err}");
        assert!(err.contains("page-timeout-secs"), "{err}");
    }
    // Valid settings, but an address this host does not have: exit 1.
    let (code, err) = run(&[], TOKEN).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot listen"), "{err}");
}

/// A client that shows redirects instead of following them.
fn no_redirects() -> reqwest::Client {
    embed_dlq::http::client_builder().redirect(reqwest::redirect::Policy::none()).build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_redirects_only_to_a_path_of_this_console() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let served = serve_console(&db, &keys, false).await;
    let http = no_redirects();
    let login = async |next: &str| {
        let body = format!("token={TOKEN}&name=probe&next={next}");
        http.post(format!("{}/login", served.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .unwrap()
    };
    // `next` as the form sends it (percent-encoded): a tab that Chromium strips, line
    // breaks and a NUL that cannot go in a header, a space, `//` and backslashes.
    for hostile in [
        "/%09/evil.example",
        "/%0a/evil.example",
        "/%0d%0a/evil.example",
        "/%0d%0aSet-Cookie:%20x=1",
        "/%00/evil.example",
        "/%20/evil.example",
        "%09//evil.example",
        "//evil.example",
        "/%5Cevil.example",
        "https://evil.example/",
    ] {
        let r = login(hostile).await;
        assert_eq!(r.status().as_u16(), 303, "{hostile}");
        assert_eq!(r.headers()["location"], "/", "{hostile}");
        assert!(r.headers().get("set-cookie").is_some(), "{hostile}: the login itself worked");
    }
    let r = login("/dlq%3Fclass%3Dtransient").await;
    assert_eq!(r.status().as_u16(), 303);
    assert_eq!(r.headers()["location"], "/dlq?class=transient");
    // One session and one audit entry per login, none half-made.
    assert_eq!(db.count("SELECT count(*) FROM console_audit WHERE action = 'login'").await, 11);
    served.stop().await;
}

/// Serves a console with `config` on `listener` (its `listen` is the listener's address).
async fn serve_with(
    db: &TestDb,
    keys: &StreamKeys,
    listener: tokio::net::TcpListener,
    config: ConsoleConfig,
) -> Served {
    let store = embed_dlq::store::Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let console = Console {
        store,
        redis: Some(redis_client()),
        keys: keys.clone(),
        gate: None,
        config: ConsoleConfig { listen: addr, ..config },
    };
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let handle = tokio::spawn(async move {
        embed_dlq::console::serve_on(listener, console, stop).await.expect("console serves");
    });
    // Reached through loopback whatever it listens on.
    Served { base: format!("http://127.0.0.1:{}", addr.port()), cancel, handle }
}

/// The session cookie (`name=value`) a login with the token answers with.
async fn session_cookie(base: &str) -> String {
    let r = no_redirects()
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={TOKEN}&name=reader&next=/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 303, "the login works");
    let set = r.headers()["set-cookie"].to_str().unwrap();
    set.split(';').next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_need_a_session_beyond_loopback_unless_public_read() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    const SECRET_TEXT: &str = "customer secret text 7f3a";
    seed(&db, &keys, MockConfig::default(), &[line("private", 0, &format!("{POISON_400} {SECRET_TEXT}"))])
        .await;
    let id = ids_of_class(&db, "permanent_input").await[0];
    let reads = [
        "/".to_string(),
        "/dlq".to_string(),
        format!("/dlq/{id}"),
        "/dlq?doc_prefix=priv".to_string(),
        "/events".to_string(),
        "/events/stream?from=0".to_string(),
        "/audit".to_string(),
        "/audit/1".to_string(),
        "/reconcile".to_string(),
        "/actions/requeue?doc_prefix=priv".to_string(),
    ];
    let http = no_redirects();
    let token = Some(ConsoleToken::new(TOKEN.into()).unwrap());
    let get = async |base: &str, path: &str, cookie: Option<&str>| {
        let mut req = http.get(format!("{base}{path}"));
        if let Some(c) = cookie {
            req = req.header("cookie", c);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        if path.starts_with("/events/stream") {
            return (status, String::new()); // a live stream: its status is the answer
        }
        (status, r.text().await.unwrap())
    };

    // Beyond loopback (every interface): no session, no page, nothing of the row.
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let exposed =
        serve_with(&db, &keys, listener, ConsoleConfig { token: token.clone(), ..Default::default() }).await;
    for p in &reads {
        let (status, body) = get(&exposed.base, p, None).await;
        assert_eq!(status, 401, "{p} without a session");
        assert!(!body.contains(SECRET_TEXT) && !body.contains("private"), "{p} leaked:\n{body}");
        if !p.starts_with("/events/stream") {
            assert!(body.contains("id=\"login\""), "{p} offers the login form");
        }
    }
    // The login page and the style sheet stay reachable.
    assert_eq!(get(&exposed.base, "/login", None).await.0, 200);
    assert_eq!(get(&exposed.base, "/static/console.css", None).await.0, 200);
    // A stale or forged cookie is no session.
    let forged = format!("embed_dlq_console={}", "ab".repeat(32));
    assert_eq!(get(&exposed.base, &format!("/dlq/{id}"), Some(&forged)).await.0, 401);
    // Logged in: every page.
    let cookie = session_cookie(&exposed.base).await;
    for p in &reads {
        let (status, body) = get(&exposed.base, p, Some(&cookie)).await;
        assert_eq!(status, 200, "{p} with a session");
        if p == &format!("/dlq/{id}") {
            assert!(body.contains(SECRET_TEXT), "the row's text, once logged in");
        }
    }
    exposed.stop().await;

    // Beyond loopback, read-only: a login still opens the pages, and no action.
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let ro = serve_with(
        &db,
        &keys,
        listener,
        ConsoleConfig { token: token.clone(), read_only: true, ..Default::default() },
    )
    .await;
    assert_eq!(get(&ro.base, &format!("/dlq/{id}"), None).await.0, 401);
    let cookie = session_cookie(&ro.base).await;
    let (status, body) = get(&ro.base, &format!("/dlq/{id}"), Some(&cookie)).await;
    assert_eq!(status, 200);
    assert!(body.contains(SECRET_TEXT));
    let r = http
        .post(format!("{}/actions/purge", ro.base))
        .header("cookie", &cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body("max_id=1000000&confirm=purge&csrf=x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403, "read-only refuses actions, logged in or not");
    ro.stop().await;

    // Beyond loopback with --public-read: readable without a session (the operator's choice).
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let public = serve_with(
        &db,
        &keys,
        listener,
        ConsoleConfig { token: token.clone(), public_read: true, ..Default::default() },
    )
    .await;
    for p in &reads {
        assert_eq!(get(&public.base, p, None).await.0, 200, "{p} with --public-read");
    }
    public.stop().await;

    // On loopback: readable without a session, as before.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let local = serve_with(&db, &keys, listener, ConsoleConfig { token, ..Default::default() }).await;
    let (status, body) = get(&local.base, &format!("/dlq/{id}"), None).await;
    assert_eq!(status, 200);
    assert!(body.contains(SECRET_TEXT));
    local.stop().await;
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'purged'").await, 0);

    // Beyond loopback without a token, nobody could ever read: a usage error (exit 2),
    // unless --public-read says so.
    let run = async |args: &[&str]| {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
            .arg("console")
            .args(["--database-url", &db.url, "--listen", "192.0.2.1:8088"])
            .args(args)
            .env_remove("EMBED_DLQ_CONSOLE_TOKEN")
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (code, err) = run(&[]).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--public-read") && err.contains("EMBED_DLQ_CONSOLE_TOKEN"), "{err}");
    let (code, err) = run(&["--public-read"]).await;
    assert_eq!(code, Some(1), "past the check, the bind fails: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_row_is_shown_bounded_and_its_views_are_capped() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    // A 24 MB text, parked as too long without a request (the payload keeps all of it).
    let text = format!("HEAD-MARK {} TAIL-MARK", "x".repeat(24 * 1024 * 1024));
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.options.max_line_bytes = 64 * 1024 * 1024;
    pipeline(&s)
        .await
        .run(input(line("huge", 0, &text).into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    let id = ids_of_class(&db, "permanent_input").await[0];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let served =
        serve_with(&db, &keys, listener, ConsoleConfig { max_row_views: 1, ..Default::default() }).await;
    let http = embed_dlq::http::client_builder().build().unwrap();
    let page = format!("{}/dlq/{id}", served.base);
    let download = format!("{}/dlq/{id}/text", served.base);

    // The page shows the start of the text, says it is cut, and links the whole text.
    let r = http.get(&page).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let body = r.text().await.unwrap();
    assert!(body.len() < 256 * 1024, "the page is {} bytes", body.len());
    assert!(body.contains("HEAD-MARK") && !body.contains("TAIL-MARK"), "the start only");
    assert!(body.contains("id=\"text-truncated\""), "says it is cut");
    assert!(body.contains(&format!("href=\"/dlq/{id}/text\"")), "links the whole text");

    // The download is the whole text, exactly.
    let r = http.get(&download).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    assert!(r.headers()["content-disposition"].to_str().unwrap().starts_with("attachment"));
    let whole = r.bytes().await.unwrap();
    assert!(whole == text.as_bytes(), "the download is the text ({} of {} bytes)", whole.len(), text.len());

    // One view at a time here: while a download is open (and not read on), another view
    // is told to come back rather than queued or loaded.
    let mut held = http.get(&download).send().await.unwrap();
    assert_eq!(held.status().as_u16(), 200);
    let first = held.chunk().await.unwrap().expect("the download started");
    assert!(first.starts_with(b"HEAD-MARK"));
    for url in [&page, &download] {
        let r = http.get(url).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 503, "{url}");
        let wait: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&wait), "{wait}");
    }
    // The reader leaves: its slot comes back.
    drop(held);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if http.get(&page).send().await.unwrap().status().as_u16() == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the slot was never freed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A row without such text has no download; an unknown row neither.
    assert_eq!(
        http.get(format!("{}/dlq/999999/text", served.base)).send().await.unwrap().status().as_u16(),
        404
    );
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_cookie_is_secure_beyond_loopback_or_when_asked() {
    use embed_dlq::console::CookieSecure;
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let token = Some(ConsoleToken::new(TOKEN.into()).unwrap());
    for (bind, secure, expected) in [
        ("127.0.0.1:0", CookieSecure::Auto, false),
        ("0.0.0.0:0", CookieSecure::Auto, true),
        ("127.0.0.1:0", CookieSecure::Always, true),
        ("0.0.0.0:0", CookieSecure::Never, false),
    ] {
        let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
        let config = ConsoleConfig { token: token.clone(), cookie_secure: secure, ..Default::default() };
        let served = serve_with(&db, &keys, listener, config).await;
        let r = no_redirects()
            .post(format!("{}/login", served.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={TOKEN}&name=c&next=/"))
            .send()
            .await
            .unwrap();
        let set = r.headers()["set-cookie"].to_str().unwrap().to_string();
        assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"), "{set}");
        assert_eq!(set.split(';').any(|a| a.trim() == "Secure"), expected, "{bind} {secure:?}: {set}");
        served.stop().await;
    }
}

/// The security headers every response carries, checked on pages, assets, refusals and a
/// page past its time limit.
fn assert_security_headers(r: &reqwest::Response, what: &str) {
    let h = r.headers();
    let csp = h.get("content-security-policy").map(|v| v.to_str().unwrap()).unwrap_or_default();
    assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"), "{what}: {csp:?}");
    assert_eq!(h.get("x-content-type-options").map(|v| v.to_str().unwrap()), Some("nosniff"), "{what}");
    assert_eq!(h.get("x-frame-options").map(|v| v.to_str().unwrap()), Some("DENY"), "{what}");
    assert_eq!(h.get("referrer-policy").map(|v| v.to_str().unwrap()), Some("no-referrer"), "{what}");
    assert!(h.get("cache-control").is_some(), "{what}: no cache-control");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_is_guarded_and_a_stuck_page_ends_at_its_time_limit() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // A limit no healthy page of a loaded machine reaches (the first one must answer 200).
    let config = ConsoleConfig { page_timeout: Duration::from_secs(4), ..Default::default() };
    let served = serve_with(&db, &keys, listener, config).await;
    let http = no_redirects();

    let page = http.get(format!("{}/dlq", served.base)).send().await.unwrap();
    assert_eq!(page.status().as_u16(), 200);
    assert_security_headers(&page, "a page");
    assert_eq!(page.headers()["cache-control"], "no-store", "pages hold customer data");
    let css = http.get(format!("{}/static/console.css", served.base)).send().await.unwrap();
    assert_security_headers(&css, "an asset");
    assert_eq!(css.headers()["cache-control"], "max-age=300", "an asset keeps its own caching");
    let rebound =
        http.get(format!("{}/dlq", served.base)).header("host", "evil.example").send().await.unwrap();
    assert_eq!(rebound.status().as_u16(), 421, "another site's name is refused");
    assert_security_headers(&rebound, "a refusal");

    // A page whose query cannot run (the DLQ table locked by another session) ends at the
    // limit with a 503, and the console answers again once the lock is gone.
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE embedding_dlq IN ACCESS EXCLUSIVE MODE").execute(&mut *locker).await.unwrap();
    let started = std::time::Instant::now();
    let stuck =
        tokio::time::timeout(Duration::from_secs(20), http.get(format!("{}/dlq", served.base)).send())
            .await
            .expect("the time limit ends the page, not the client")
            .unwrap();
    assert_eq!(stuck.status().as_u16(), 503);
    assert!(started.elapsed() >= Duration::from_secs(4), "not before the limit");
    assert_security_headers(&stuck, "a page past its limit");
    locker.rollback().await.unwrap();
    let again = http.get(format!("{}/dlq", served.base)).send().await.unwrap();
    assert_eq!(again.status().as_u16(), 200);
    served.stop().await;
}

/// The overview lists each revision of a target that has them: its state, model, dimension,
/// chunks, DLQ rows and how much of the active revision it covers; the oracle is the corpus
/// the test wrote (20 chunks, one the provider rejects) and the shadow it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_each_revision_and_its_coverage() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let lines: Vec<String> = (0..20)
        .map(|i| {
            line("rev", i, &if i == 7 { format!("{} poisoned", POISON_400) } else { format!("rev {i}") })
        })
        .collect();
    seed(&db, &keys, MockConfig::default(), &lines).await;
    let served = serve_console(&db, &keys, true).await;
    let client = embed_dlq::http::client_builder().build().unwrap();
    let body = client.get(format!("{}/", served.base)).send().await.unwrap().text().await.unwrap();
    assert!(!body.contains("id=\"revisions\""), "no revisions, no section");
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
    let body = client.get(format!("{}/", served.base)).send().await.unwrap().text().await.unwrap();
    let table =
        body.split("id=\"revisions\"").nth(1).expect("a revisions table").split("</table>").next().unwrap();
    let rows: Vec<Vec<String>> = table
        .split("<tr>")
        .skip(2)
        .map(|r| {
            r.split("<td")
                .skip(1)
                .map(|c| {
                    let c = c.split_once('>').map_or("", |(_, v)| v);
                    let mut text = String::new();
                    let mut in_tag = false;
                    for ch in c.split("</td>").next().unwrap().chars() {
                        match ch {
                            '<' => in_tag = true,
                            '>' => in_tag = false,
                            _ if !in_tag => text.push(ch),
                            _ => {}
                        }
                    }
                    text.trim().to_string()
                })
                .collect()
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            vec!["public.doc_embeddings", "1", "active", "mock", "768", "20", "1", "-"],
            vec![
                "public.doc_embeddings",
                "2",
                "shadow",
                "mock-next",
                "256",
                "0",
                "0",
                "0 of 20 (0.0%): 20 not covered"
            ],
        ],
        "{table}"
    );
    served.stop().await;
}

/// The overview lists each Postgres table source with its snapshot state, queued changes,
/// lag and triggers; a trigger dropped by hand shows as missing. The oracle is what the
/// test queued (three inserts after the source was added) and the trigger it dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_each_table_source_its_queue_and_a_missing_trigger() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    seed(&db, &keys, MockConfig::default(), &[line("t", 0, "seed")]).await;
    let served = serve_console(&db, &keys, true).await;
    let client = embed_dlq::http::client_builder().build().unwrap();
    let page = async || client.get(format!("{}/", served.base)).send().await.unwrap().text().await.unwrap();
    assert!(!page().await.contains("id=\"table-sources\""), "no table source, no section");
    sqlx::raw_sql("CREATE TABLE notes (id bigint PRIMARY KEY, body text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
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
    sqlx::raw_sql("INSERT INTO notes VALUES (1, 'a'), (2, 'b'), (3, 'c')").execute(&db.pool).await.unwrap();
    let body = page().await;
    let section = body.split("id=\"table-sources\"").nth(1).expect("a table sources table");
    let row = section.split("</table>").next().unwrap();
    assert!(row.contains("<code>notes</code>") && row.contains("pending"), "{row}");
    assert!(row.contains(">3</td>"), "three changes queued: {row}");
    assert!(row.contains(">ok</td>"), "{row}");
    sqlx::raw_sql("DROP TRIGGER embed_dlq_notes_update ON notes").execute(&db.pool).await.unwrap();
    let body = page().await;
    let row = body.split("id=\"table-sources\"").nth(1).unwrap().split("</table>").next().unwrap();
    assert!(row.contains("missing: embed_dlq_notes_update"), "{row}");
    served.stop().await;
}
