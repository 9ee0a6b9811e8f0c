//! The dozen W3C WebDriver commands the console's browser tests send to chromedriver, over
//! the crate's own HTTP client. A WebDriver crate (fantoccini) brought about 60 s of
//! compile time on two cores (a second ICU, thiserror 1, cookie and time stacks) for what
//! is here a few JSON requests (BENCHMARKS.md "Test time").
//!
//! Every command is `METHOD /session/{id}/...` with a JSON body; the answer is
//! `{"value": ...}`, and an error is `{"value": {"error": ..., "message": ...}}` with a
//! non-2xx status (https://www.w3.org/TR/webdriver2/).

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};

/// The key under which WebDriver names an element in a JSON answer.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// One WebDriver session (one browser).
pub struct Session {
    http: reqwest::Client,
    /// `{driver}/session/{id}`.
    base: String,
}

/// An element of the session's current page.
pub struct Element<'s> {
    session: &'s Session,
    id: String,
}

/// A command WebDriver refused (`error` is the protocol's error code, e.g. "no such element").
#[derive(Debug)]
pub struct CommandError {
    pub error: String,
    pub message: String,
}

impl std::fmt::Display for CommandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.error, self.message)
    }
}

pub type Result<T> = std::result::Result<T, CommandError>;

async fn send(request: reqwest::RequestBuilder) -> Result<Value> {
    let transport = |e: reqwest::Error| CommandError { error: "transport".into(), message: e.to_string() };
    let response = request.send().await.map_err(transport)?;
    let ok = response.status().is_success();
    let mut body: Value = response.json().await.map_err(transport)?;
    let value = body["value"].take();
    if ok {
        return Ok(value);
    }
    let field = |k: &str| value[k].as_str().unwrap_or_default().to_string();
    Err(CommandError { error: field("error"), message: field("message") })
}

fn element_id(value: &Value) -> Result<String> {
    value[ELEMENT_KEY].as_str().map(str::to_string).ok_or_else(|| CommandError {
        error: "protocol".into(),
        message: format!("no element reference in {value}"),
    })
}

impl Session {
    /// Opens a session on the chromedriver at `driver` with `chrome_options`
    /// (`goog:chromeOptions`), a script timeout of `script` and a page-load timeout of
    /// `page_load`; lookups never wait implicitly (the tests poll).
    pub async fn start(
        driver: &str,
        chrome_options: Value,
        script: Duration,
        page_load: Duration,
    ) -> Result<Session> {
        let http = embed_dlq::http::client_builder().build().expect("an HTTP client");
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": chrome_options,
        }}});
        let created = send(http.post(format!("{driver}/session")).json(&capabilities)).await?;
        let id = created["sessionId"].as_str().ok_or_else(|| CommandError {
            error: "protocol".into(),
            message: format!("no session id in {created}"),
        })?;
        let session = Session { http, base: format!("{driver}/session/{id}") };
        let timeouts = json!({
            "script": script.as_millis() as u64,
            "pageLoad": page_load.as_millis() as u64,
            "implicit": 0,
        });
        session.post("timeouts", timeouts).await?;
        Ok(session)
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value> {
        send(self.http.post(format!("{}/{path}", self.base)).json(&body)).await
    }

    async fn get(&self, path: &str) -> Result<Value> {
        send(self.http.get(format!("{}/{path}", self.base))).await
    }

    /// Loads `url` and waits for it (up to the page-load timeout).
    pub async fn goto(&self, url: &str) -> Result<()> {
        self.post("url", json!({"url": url})).await.map(drop)
    }

    /// The URL of the current page.
    pub async fn current_url(&self) -> Result<String> {
        Ok(self.get("url").await?.as_str().unwrap_or_default().to_string())
    }

    /// The first element matching `css`, now ("no such element" if there is none).
    pub async fn find(&self, css: &str) -> Result<Element<'_>> {
        let found = self.post("element", json!({"using": "css selector", "value": css})).await?;
        Ok(Element { session: self, id: element_id(&found)? })
    }

    /// Every element matching `css`, now.
    pub async fn find_all(&self, css: &str) -> Result<Vec<Element<'_>>> {
        let found = self.post("elements", json!({"using": "css selector", "value": css})).await?;
        let list = found.as_array().cloned().unwrap_or_default();
        list.iter().map(|v| Ok(Element { session: self, id: element_id(v)? })).collect()
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and returns what it returns.
    pub async fn execute(&self, script: &str, args: Vec<Value>) -> Result<Value> {
        self.post("execute/sync", json!({"script": script, "args": args})).await
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Result<Vec<u8>> {
        let encoded = self.get("screenshot").await?;
        base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().unwrap_or_default())
            .map_err(|e| CommandError { error: "protocol".into(), message: e.to_string() })
    }

    /// Ends the session (the browser quits).
    pub async fn close(self) -> Result<()> {
        send(self.http.delete(&self.base)).await.map(drop)
    }
}

impl Element<'_> {
    /// The element's rendered text.
    pub async fn text(&self) -> Result<String> {
        let text = self.session.get(&format!("element/{}/text", self.id)).await?;
        Ok(text.as_str().unwrap_or_default().to_string())
    }

    /// Clicks the element (scrolled into view first by the driver).
    pub async fn click(&self) -> Result<()> {
        self.session.post(&format!("element/{}/click", self.id), json!({})).await.map(drop)
    }

    /// Types `text` into the element.
    pub async fn send_keys(&self, text: &str) -> Result<()> {
        self.session.post(&format!("element/{}/value", self.id), json!({"text": text})).await.map(drop)
    }

    /// Chooses the `<option>` of this `<select>` whose value is `value`.
    pub async fn select_by_value(&self, value: &str) -> Result<()> {
        let css = format!("option[value=\"{value}\"]");
        let option = self
            .session
            .post(&format!("element/{}/element", self.id), json!({"using": "css selector", "value": css}))
            .await?;
        let option = Element { session: self.session, id: element_id(&option)? };
        option.click().await
    }
}
