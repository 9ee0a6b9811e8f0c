//! The list's filter as it travels through URLs, forms and the audit trail: parsed from a
//! query string or a form with every value bounded, turned into the store's
//! [`RowFilter`], and written back as query pairs (links, the confirmation form's hidden
//! fields) and as JSON (the audit entry).

use serde::Deserialize;

use crate::model::ErrorClass;
use crate::store::console::{Cursor, SortKey};
use crate::store::dlq::RowFilter;

/// Longest doc id prefix accepted (a doc id is at most 1024 bytes).
pub const MAX_DOC_PREFIX: usize = 1024;
/// Longest reason accepted (reasons are short codes such as `http_503`).
pub const MAX_REASON: usize = 128;
/// Longest target table name accepted (`schema.table`, each part at most 63 bytes, quoted).
pub const MAX_TABLE: usize = 140;
/// Longest model name accepted (provider model ids are short; gateways prefix a route).
pub const MAX_MODEL: usize = 256;
/// Longest cursor key accepted (a doc id, a timestamp or a number as text).
pub const MAX_CURSOR: usize = 1100;
/// Highest minimum-attempts filter.
pub const MAX_MIN_ATTEMPTS: i64 = 1_000_000;
/// Highest age filter (100 years, as `dlq --older-than-secs`).
pub const MAX_OLDER_THAN_SECS: u64 = 100 * 365 * 24 * 3600;
/// Page sizes the list offers; others are clamped into 10..=500.
pub const PAGE_SIZES: [i64; 4] = [25, 50, 100, 500];
/// Default page size.
pub const DEFAULT_PAGE_SIZE: i64 = 50;

/// The age choices of the filter form, in seconds, with their labels.
pub const AGES: [(u64, &str); 5] = [
    (300, "older than 5 min"),
    (3600, "older than 1 h"),
    (86_400, "older than 1 day"),
    (604_800, "older than 7 days"),
    (2_592_000, "older than 30 days"),
];

/// The raw query string or form, every field optional and taken as text (an empty field
/// means "no filter"), so a bad value gets a message instead of a bare 400.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RawQuery {
    pub class: Option<String>,
    pub reason: Option<String>,
    pub doc_prefix: Option<String>,
    pub table: Option<String>,
    pub model: Option<String>,
    pub older_than: Option<String>,
    pub min_attempts: Option<String>,
    pub exhausted: Option<String>,
    pub id: Option<String>,
    pub sort: Option<String>,
    pub desc: Option<String>,
    pub after: Option<String>,
    pub after_id: Option<String>,
    pub limit: Option<String>,
}

/// A validated filter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    pub class: Option<ErrorClass>,
    pub reason: Option<String>,
    pub doc_prefix: Option<String>,
    pub table: Option<String>,
    /// Rows parked under this model (one the provider has retired since, say).
    pub model: Option<String>,
    pub older_than: Option<u64>,
    pub min_attempts: Option<i32>,
    pub exhausted: bool,
    pub id: Option<i64>,
}

/// A validated list request: the filter, the order and the page.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    pub filter: ListFilter,
    pub sort: SortKey,
    pub desc: bool,
    pub after: Option<Cursor>,
    pub limit: i64,
}

fn text(v: &Option<String>) -> Option<&str> {
    v.as_deref().filter(|s| !s.is_empty())
}

fn bounded(name: &str, v: &Option<String>, max: usize) -> Result<Option<String>, String> {
    match text(v) {
        None => Ok(None),
        Some(s) if s.len() > max => Err(format!("{name} is longer than {max} bytes")),
        Some(s) => Ok(Some(s.to_string())),
    }
}

fn number<T: std::str::FromStr>(name: &str, v: &Option<String>) -> Result<Option<T>, String> {
    match text(v) {
        None => Ok(None),
        Some(s) => s.trim().parse().map(Some).map_err(|_| format!("{name} is not a number")),
    }
}

impl RawQuery {
    /// The filter part, validated.
    pub fn filter(&self) -> Result<ListFilter, String> {
        let class = match text(&self.class) {
            None => None,
            Some(c) => Some(ErrorClass::parse(c).ok_or_else(|| "class is not an error class".to_string())?),
        };
        let older_than = number::<u64>("older_than", &self.older_than)?;
        if older_than.is_some_and(|s| s > MAX_OLDER_THAN_SECS) {
            return Err(format!("older_than is out of range: allowed 0..={MAX_OLDER_THAN_SECS}"));
        }
        let min_attempts = number::<i64>("min_attempts", &self.min_attempts)?;
        if min_attempts.is_some_and(|a| !(0..=MAX_MIN_ATTEMPTS).contains(&a)) {
            return Err(format!("min_attempts is out of range: allowed 0..={MAX_MIN_ATTEMPTS}"));
        }
        Ok(ListFilter {
            class,
            reason: bounded("reason", &self.reason, MAX_REASON)?,
            doc_prefix: bounded("doc_prefix", &self.doc_prefix, MAX_DOC_PREFIX)?,
            table: bounded("table", &self.table, MAX_TABLE)?,
            model: bounded("model", &self.model, MAX_MODEL)?,
            older_than,
            min_attempts: min_attempts.map(|a| a as i32),
            exhausted: matches!(text(&self.exhausted), Some("1" | "on" | "true")),
            id: number::<i64>("id", &self.id)?,
        })
    }

    /// The whole list request, validated; page sizes are clamped to 10..=500.
    pub fn list(&self) -> Result<ListQuery, String> {
        let filter = self.filter()?;
        let sort = match text(&self.sort) {
            None => SortKey::Id,
            Some(s) => SortKey::parse(s).ok_or_else(|| "sort is not a column".to_string())?,
        };
        let after =
            match (bounded("after", &self.after, MAX_CURSOR)?, number::<i64>("after_id", &self.after_id)?) {
                (Some(key), Some(id)) => Some(Cursor { key, id }),
                (None, None) => None,
                _ => return Err("after and after_id go together".into()),
            };
        let limit = number::<i64>("limit", &self.limit)?.unwrap_or(DEFAULT_PAGE_SIZE).clamp(10, 500);
        Ok(ListQuery { filter, sort, desc: matches!(text(&self.desc), Some("1" | "true")), after, limit })
    }
}

impl ListFilter {
    /// The store's filter, limited to rows up to `max_id` when given.
    pub fn rows(&self, max_id: Option<i64>) -> RowFilter {
        RowFilter {
            class: self.class,
            doc: None,
            doc_prefix: self.doc_prefix.clone(),
            older_than_secs: self.older_than,
            min_attempts: self.min_attempts,
            model: self.model.clone(),
            exhausted: self.exhausted,
            id: self.id,
            reason: self.reason.clone(),
            table: self.table.clone(),
            max_id,
        }
    }

    /// Whether the filter selects every row.
    pub fn is_empty(&self) -> bool {
        *self == ListFilter::default()
    }

    /// The filter as query pairs (empty fields left out), for links and hidden form fields.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut p = Vec::new();
        if let Some(c) = self.class {
            p.push(("class", c.as_str().to_string()));
        }
        if let Some(r) = &self.reason {
            p.push(("reason", r.clone()));
        }
        if let Some(d) = &self.doc_prefix {
            p.push(("doc_prefix", d.clone()));
        }
        if let Some(t) = &self.table {
            p.push(("table", t.clone()));
        }
        if let Some(m) = &self.model {
            p.push(("model", m.clone()));
        }
        if let Some(o) = self.older_than {
            p.push(("older_than", o.to_string()));
        }
        if let Some(a) = self.min_attempts {
            p.push(("min_attempts", a.to_string()));
        }
        if self.exhausted {
            p.push(("exhausted", "1".into()));
        }
        if let Some(id) = self.id {
            p.push(("id", id.to_string()));
        }
        p
    }

    /// The filter as JSON, for the audit trail.
    pub fn json(&self, max_id: Option<i64>) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (k, v) in self.pairs() {
            m.insert(k.into(), v.into());
        }
        if let Some(max) = max_id {
            m.insert("max_id".into(), max.into());
        }
        serde_json::Value::Object(m)
    }

    /// A short human description ("class transient, reason http_503"), or "every row".
    pub fn describe(&self) -> String {
        let p = self.pairs();
        if p.is_empty() {
            return "every row".into();
        }
        p.iter().map(|(k, v)| format!("{} {v}", k.replace('_', " "))).collect::<Vec<_>>().join(", ")
    }
}

/// `pairs` as a query string (each part percent-encoded).
pub fn query_string(pairs: &[(&str, String)]) -> String {
    let mut s = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        s.append_pair(k, v);
    }
    s.finish()
}

impl ListQuery {
    /// Query pairs of this request with another order or page (links in the header and the
    /// pager).
    pub fn pairs_with(
        &self,
        sort: SortKey,
        desc: bool,
        after: Option<&Cursor>,
    ) -> Vec<(&'static str, String)> {
        let mut p = self.filter.pairs();
        if sort != SortKey::Id {
            p.push(("sort", sort.as_str().into()));
        }
        if desc {
            p.push(("desc", "1".into()));
        }
        if let Some(c) = after {
            p.push(("after", c.key.clone()));
            p.push(("after_id", c.id.to_string()));
        }
        if self.limit != DEFAULT_PAGE_SIZE {
            p.push(("limit", self.limit.to_string()));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(pairs: &[(&str, &str)]) -> RawQuery {
        let q = query_string(&pairs.iter().map(|(k, v)| (*k, v.to_string())).collect::<Vec<_>>());
        serde_urlencoded::from_str(&q).unwrap()
    }

    #[test]
    fn empty_fields_mean_no_filter() {
        let q = raw(&[("class", ""), ("reason", ""), ("older_than", ""), ("limit", "")]).list().unwrap();
        assert!(q.filter.is_empty());
        assert_eq!(q.limit, DEFAULT_PAGE_SIZE);
        assert_eq!(q.sort, SortKey::Id);
    }

    #[test]
    fn values_are_bounded() {
        assert!(raw(&[("class", "nope")]).filter().is_err());
        assert!(raw(&[("min_attempts", "-1")]).filter().is_err());
        assert!(raw(&[("min_attempts", "99999999999")]).filter().is_err());
        assert!(raw(&[("older_than", &(MAX_OLDER_THAN_SECS + 1).to_string())]).filter().is_err());
        assert!(raw(&[("doc_prefix", &"x".repeat(MAX_DOC_PREFIX + 1))]).filter().is_err());
        assert!(raw(&[("model", &"m".repeat(MAX_MODEL + 1))]).filter().is_err());
        assert!(raw(&[("sort", "id; drop table")]).list().is_err());
        assert!(raw(&[("after", "5")]).list().is_err(), "a cursor needs both parts");
        assert_eq!(raw(&[("limit", "100000")]).list().unwrap().limit, 500);
        assert_eq!(raw(&[("limit", "1")]).list().unwrap().limit, 10);
    }

    #[test]
    fn a_filter_round_trips_through_its_query_pairs() {
        let f = raw(&[
            ("class", "transient"),
            ("reason", "http_503"),
            ("doc_prefix", "a&b=<c>"),
            ("table", "public.doc_embeddings"),
            ("model", "text-embedding-ada-002"),
            ("older_than", "3600"),
            ("min_attempts", "3"),
            ("exhausted", "1"),
        ])
        .filter()
        .unwrap();
        let back =
            serde_urlencoded::from_str::<RawQuery>(&query_string(&f.pairs())).unwrap().filter().unwrap();
        assert_eq!(back, f);
        let rows = f.rows(Some(9));
        assert_eq!(rows.max_id, Some(9));
        assert_eq!(rows.doc_prefix.as_deref(), Some("a&b=<c>"));
        assert_eq!(rows.model.as_deref(), Some("text-embedding-ada-002"));
        assert_eq!(f.json(Some(9))["max_id"], 9);
    }
}
