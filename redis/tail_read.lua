-- One read of `tail` on one events stream shard, together with the stream's bookkeeping at
-- that very moment (a script runs atomically, so no trim can slip between the two).
--
-- KEYS[1]  the shard's events stream
-- ARGV[1]  the reader's position: the last entry id it delivered ("0" before the first one)
-- ARGV[2]  most entries to return
--
-- Returns {} when the stream does not exist, else
--   {length, entries-added, first entry id ("" when empty), max-deleted-entry-id,
--    last-generated-id, entries after ARGV[1] (an XRANGE reply)}
-- From these the reader tells whether entries it never saw were trimmed (the first entry is
-- past its position) and how many (entries-added minus length minus the entries-added count
-- at its position, which it keeps). XINFO STREAM's `entries-added` and `max-deleted-entry-id`
-- need Redis 7.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {}
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local length, added, first, deleted, last = 0, 0, '', '0-0', '0-0'
for i = 1, #info, 2 do
  local k, v = info[i], info[i + 1]
  if k == 'length' then length = v
  elseif k == 'entries-added' then added = v
  elseif k == 'max-deleted-entry-id' then deleted = v
  elseif k == 'last-generated-id' then last = v
  elseif k == 'first-entry' and type(v) == 'table' then first = v[1]
  end
end
local entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
return {length, added, first, deleted, last, entries}
