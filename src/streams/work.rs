//! Reading replay work items ([`WorkItem`]) from replay stream entries: the item's JSON is
//! the entry's `body` field, parsed by [`WorkItem::parse_body`] (the type lives in
//! [`crate::model`], below both the store that writes it and the streams that carry it).

use std::collections::HashMap;

pub use crate::model::WorkItem;

use super::field;

/// The work item of a replay stream entry (its `body` field); `None` for an entry that does
/// not carry a current work item.
pub fn from_entry(map: &HashMap<String, redis::Value>) -> Option<WorkItem> {
    WorkItem::parse_body(&field(map, "body")?)
}
