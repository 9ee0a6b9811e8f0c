//! Reading replay work items ([`WorkItem`]) from replay stream entries: the items' JSON is
//! the entry's `body` field, parsed by [`WorkItem::parse_entry_body`] (the type lives in
//! [`crate::model`], below both the store that writes it and the streams that carry it).

use std::collections::HashMap;

pub use crate::model::WorkItem;

use super::field;

/// The work items of a replay stream entry (its `body` field: a batch, or one item written
/// by an earlier release); `None` for an entry that does not carry current work items.
pub fn from_entry(map: &HashMap<String, redis::Value>) -> Option<Vec<WorkItem>> {
    WorkItem::parse_entry_body(&field(map, "body")?)
}
