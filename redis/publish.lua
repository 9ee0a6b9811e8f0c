-- Publish a batch of outbox rows of one stream shard, each exactly once (deduplicated by the
-- row's event_id, a random uuid: outbox ids repeat across restores, re-created databases and
-- shared prefixes). One call does the work of one call per row, so the relay pays one round
-- trip and one script dispatch for many rows.
--
-- The dedup record of an event is a field of a hash per shard and hour (the hour the outbox
-- row was created, so every retry of a row finds the same hash): field = event_id, value =
-- the entry id it became. One HMGET reads the records of all rows of the call and one HSET
-- writes the new ones, so a row costs the server its XADD and little else (a top-level key
-- with its own TTL per event cost about three times as much). Every row of a call belongs to
-- the same hash; the caller splits calls where the hour changes.
--
-- KEYS[1]   the dedup hash of the call's rows (e.g. {embed-dlq}:published:2026113014)
-- KEYS[2]   the shard's events stream
-- KEYS[3]   the shard's replay stream
-- KEYS[4..] dedup markers of the previous format ({tag}:outbox:<event_id>, a key per event)
--           of rows created before the upgrade that introduced the hashes; a row names its
--           marker by index, so an event published by an older relay is still seen.
--   Every key must share one hash tag (one shard), so the call stays in one Redis Cluster slot.
-- ARGV[1]  TTL of the dedup hash in seconds (renewed by every call that writes to it; must
--          outlive any relay retry of the same row)
-- ARGV[2]  approximate MAXLEN of the events stream, 0 for no length trimming here
-- ARGV[3]  exact MAXLEN of the replay stream, 0 for none: the outstanding-work cap. Entries
--          are read in order, so the unread ones are the newest and every live work item is
--          among the newest `cap`; what the trim removes is consumed or stale (an item whose
--          lease ran out and was issued again), and a live item it might still remove is
--          issued again when its lease ends
-- then six arguments per row, in outbox order:
--   stream     1 = events stream (KEYS[2]), 2 = replay stream (KEYS[3])
--   legacy     index in KEYS of the row's old-format marker, 0 when it has none
--   event_id   the dedup identity (also the entry's event_id field)
--   outbox_id, event, body   the entry's other fields
--
-- For each row: recorded (or old marker present) -> nothing is written and the entry id it
-- holds is returned; otherwise XADD. The new records are written before the script returns,
-- also when an XADD fails (the error is returned after the records of the rows added before
-- it), so a relay that crashed after this script ran and before it marked the rows published
-- re-runs it and gets the original entry ids back instead of second entries, whatever subset
-- of the rows had already been published.
-- Returns one {entry_id, added} pair per row, in the rows' order: added is 1 when the entry
-- was appended by this call, 0 when it was a duplicate.
--
-- A script blocks the server while it runs: the caller bounds the rows per call (the relay's
-- rows_per_call). To publish an event again on purpose (the reconciler found its entry
-- missing), delete its record (HDEL) and old marker first.
local PER_ROW = 6
local ttl = tonumber(ARGV[1])
local maxlen = tonumber(ARGV[2])
local replay_maxlen = tonumber(ARGV[3])
local HEADER = 3
if #KEYS < 3 then
  return redis.error_reply('ERR publish.lua: KEYS must start with the dedup hash and the two streams')
end
if not ttl or ttl < 1 then
  return redis.error_reply('ERR publish.lua: the dedup TTL must be a positive number of seconds')
end
if not maxlen or maxlen < 0 or not replay_maxlen or replay_maxlen < 0 or (#ARGV - HEADER) % PER_ROW ~= 0 then
  return redis.error_reply('ERR publish.lua: malformed ARGV (ttl, two maxlens, then six arguments per row)')
end
local rows = (#ARGV - HEADER) / PER_ROW
if rows == 0 then
  return {}
end
local ids = {}
for r = 1, rows do
  ids[r] = ARGV[HEADER + (r - 1) * PER_ROW + 3]
end
local recorded = redis.call('HMGET', KEYS[1], unpack(ids))
local added = {}
local record = {}
local function flush()
  if #record > 0 then
    redis.call('HSET', KEYS[1], unpack(record))
  end
  redis.call('EXPIRE', KEYS[1], ttl)
end
local out = {}
for r = 1, rows do
  local a = HEADER + (r - 1) * PER_ROW
  local stream = tonumber(ARGV[a + 1])
  local legacy = tonumber(ARGV[a + 2])
  local event_id = ARGV[a + 3]
  if (stream ~= 1 and stream ~= 2) or not legacy or legacy < 0 or (legacy > 0 and (legacy < 4 or legacy > #KEYS)) then
    flush()
    return redis.error_reply('ERR publish.lua: malformed ARGV for row ' .. r)
  end
  local existing = recorded[r] or added[event_id]
  if not existing and legacy > 0 then
    existing = redis.call('GET', KEYS[legacy])
  end
  if existing then
    out[r] = {existing, 0}
  else
    local id
    if stream == 1 and maxlen > 0 then
      id = redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*',
        'outbox_id', ARGV[a + 4], 'event_id', event_id, 'event', ARGV[a + 5], 'body', ARGV[a + 6])
    elseif stream == 2 and replay_maxlen > 0 then
      id = redis.pcall('XADD', KEYS[3], 'MAXLEN', replay_maxlen, '*',
        'outbox_id', ARGV[a + 4], 'event_id', event_id, 'event', ARGV[a + 5], 'body', ARGV[a + 6])
    else
      id = redis.pcall('XADD', KEYS[1 + stream], '*',
        'outbox_id', ARGV[a + 4], 'event_id', event_id, 'event', ARGV[a + 5], 'body', ARGV[a + 6])
    end
    if type(id) == 'table' and id.err then
      flush()
      return id
    end
    added[event_id] = id
    record[#record + 1] = event_id
    record[#record + 1] = id
    out[r] = {id, 1}
  end
end
flush()
return out
