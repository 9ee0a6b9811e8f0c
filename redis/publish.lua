-- Publish a batch of outbox rows of one stream shard, each exactly once (deduplicated by the
-- row's event_id, a random uuid: outbox ids repeat across restores, re-created databases and
-- shared prefixes). One call does the work of one call per row, so the relay pays one round
-- trip and one script dispatch for many rows.
--
-- KEYS, two per row, in outbox order (row i is KEYS[2i-1], KEYS[2i]):
--   KEYS[2i-1]  dedup marker of row i's event (e.g. {embed-dlq}:outbox:0b6f0c52-8a56-...)
--   KEYS[2i]    row i's target stream
--   Every key must share one hash tag (one shard), so the call stays in one Redis Cluster slot.
-- ARGV[1]  marker TTL in seconds (must outlive any relay retry of the same row)
-- then, per row i in the same order:
--   maxlen   approximate MAXLEN for the stream, or 0 for no length trimming here
--   n        number of field/value arguments that follow (even, at least 2)
--   n args   field, value, field, value, ...
--
-- For each row, atomically (Redis runs a script without interleaving anything): marker
-- present -> nothing is written and the entry id it holds is returned; marker absent ->
-- XADD, then SET marker <entry id> EX ttl. So a relay that crashes after this script ran and
-- before it marked the rows published re-runs it and gets the original entry ids back
-- instead of second entries, whatever subset of the rows had already been published.
-- Returns one {entry_id, added} pair per row, in the rows' order: added is 1 when the entry
-- was appended by this call, 0 when it was a duplicate.
--
-- A script blocks the server while it runs: the caller bounds the rows per call (the relay's
-- rows_per_call). To publish an event again on purpose (the reconciler found its entry
-- missing), delete its marker first.
if #KEYS % 2 ~= 0 then
  return redis.error_reply('ERR publish.lua: KEYS must be marker, stream pairs')
end
local ttl = tonumber(ARGV[1])
if not ttl or ttl < 1 then
  return redis.error_reply('ERR publish.lua: the marker TTL must be a positive number of seconds')
end
local out = {}
local a = 2
for i = 1, #KEYS, 2 do
  local maxlen = tonumber(ARGV[a])
  local n = tonumber(ARGV[a + 1])
  if not maxlen or not n or n < 2 or n % 2 ~= 0 or a + 1 + n > #ARGV then
    return redis.error_reply('ERR publish.lua: malformed ARGV for row ' .. ((i + 1) / 2))
  end
  local existing = redis.call('GET', KEYS[i])
  if existing then
    out[#out + 1] = {existing, 0}
  else
    local args = {KEYS[i + 1]}
    if maxlen > 0 then
      args[#args + 1] = 'MAXLEN'
      args[#args + 1] = '~'
      args[#args + 1] = maxlen
    end
    args[#args + 1] = '*'
    for j = a + 2, a + 1 + n do
      args[#args + 1] = ARGV[j]
    end
    local id = redis.call('XADD', unpack(args))
    redis.call('SET', KEYS[i], id, 'EX', ttl)
    out[#out + 1] = {id, 1}
  end
  a = a + 2 + n
end
return out
