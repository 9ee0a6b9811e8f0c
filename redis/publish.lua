-- Publish one outbox row to a stream exactly once (deduplicated by the row's event_id, a
-- random uuid: outbox ids repeat across restores, re-created databases and shared prefixes).
--
-- KEYS[1]  dedup marker for this event (e.g. {embed-dlq}:outbox:0b6f0c52-8a56-...)
-- KEYS[2]  target stream
-- ARGV[1]  marker TTL in seconds (must outlive any relay retry of the same row)
-- ARGV[2]  approximate MAXLEN for the stream, or 0 for no length trimming here
-- ARGV[3..] field, value, field, value, ...
--
-- The marker and the XADD happen atomically, so a relay that crashes after this script ran
-- and before it marked the row published re-runs it and gets the original entry id back
-- instead of a second entry. Returns {entry_id, 1} when added, {entry_id, 0} when it was a
-- duplicate. To publish an event again on purpose (the reconciler found its entry missing),
-- delete its marker first.
local existing = redis.call('GET', KEYS[1])
if existing then
  return {existing, 0}
end
local fields = {}
for i = 3, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
local id
local maxlen = tonumber(ARGV[2])
if maxlen and maxlen > 0 then
  id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*', unpack(fields))
else
  id = redis.call('XADD', KEYS[2], '*', unpack(fields))
end
redis.call('SET', KEYS[1], id, 'EX', tonumber(ARGV[1]))
return {id, 1}
