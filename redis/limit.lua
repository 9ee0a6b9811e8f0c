-- Shared provider budget: one GCRA schedule for requests and one for tokens, scaled by an
-- AIMD factor, for every process that embeds with the same provider base URL and model.
--
-- KEYS[1]  the budget's hash (embed-dlq:limit:<sha256 of base URL and model>); fields:
--          req_tat, tok_tat  theoretical arrival times in ms (Redis clock)
--          factor, factor_at  AIMD factor in (0, 1] and when it was last decreased (ms)
-- ARGV[1]  "acquire" (reserve a slot for one request) or "decrease" (a 429 was seen)
-- ARGV[2]  requests per minute, 0 for no request limit
-- ARGV[3]  tokens per minute, 0 for no token limit
-- ARGV[4]  estimated tokens of the request (clamped by the caller to one minute's budget)
-- ARGV[5]  burst in ms: how much of the schedule may be spent at once (100 ms of budget;
--          never less than the request's own cost, so a request after an idle spell goes at
--          once and the next waits its turn: even pacing)
-- ARGV[6]  multiplicative decrease on a 429 (e.g. 0.5)
-- ARGV[7]  lowest factor
-- ARGV[8]  hold-off in ms: 429s this soon after a decrease are the same congestion (requests
--          already in flight) and do not decrease again
-- ARGV[9]  additive recovery per window (e.g. 0.1)
-- ARGV[10] recovery window in ms
--
-- "acquire" always reserves: it moves both schedules forward by the request's cost and
-- returns how long the caller must wait before sending. One round trip per request, and the
-- reservations of all processes form one queue, so together they stay under the limit.
-- Returns {wait_ms, factor_permille}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local burst = tonumber(ARGV[5])
local decrease = tonumber(ARGV[6])
local min_factor = tonumber(ARGV[7])
local holdoff = tonumber(ARGV[8])
local step = tonumber(ARGV[9])
local window = tonumber(ARGV[10])

local h = redis.call('HMGET', KEYS[1], 'req_tat', 'tok_tat', 'factor', 'factor_at')
local stored = tonumber(h[3]) or 1
local factor_at = tonumber(h[4])
-- Additive recovery: one step per whole window since the last decrease.
local factor = stored
if factor < 1 and factor_at then
  local windows = math.floor(math.max(now - factor_at, 0) / window)
  factor = math.min(1, factor + windows * step)
end
-- Keep the state a while after the last use (the factor must outlive idle gaps).
local keep = 600000

if ARGV[1] == 'decrease' then
  if factor_at == nil or now - factor_at >= holdoff then
    factor = math.max(min_factor, factor * decrease)
    redis.call('HSET', KEYS[1], 'factor', string.format('%.6f', factor), 'factor_at', now)
  end
  redis.call('PEXPIRE', KEYS[1], keep)
  return {0, math.floor(factor * 1000)}
end

local go = now
local latest = now
local function reserve(field, tat, cost_ms)
  local start = math.max(tonumber(tat) or now, now)
  local new_tat = start + cost_ms
  redis.call('HSET', KEYS[1], field, string.format('%.3f', new_tat))
  go = math.max(go, new_tat - math.max(burst, cost_ms))
  latest = math.max(latest, new_tat)
end
if rpm > 0 then
  reserve('req_tat', h[1], 60000 / (rpm * factor))
end
if tpm > 0 and tokens > 0 then
  reserve('tok_tat', h[2], tokens * 60000 / (tpm * factor))
end
redis.call('PEXPIRE', KEYS[1], math.ceil(latest - now) + keep)
return {math.ceil(go - now), math.floor(factor * 1000)}
