-- fencegate fence script: compare, raise and apply in one atomic call (DESIGN.md rule 1).
--
-- KEYS[1]    the fence key of the token's resource, fencegate:fence:{<resource>}; never given a TTL
-- KEYS[2..]  the keys of the wrapped command (declared so Redis knows them; not read here)
-- ARGV[1]    the resource name (for the error message)
-- ARGV[2]    the token's revision, canonical decimal (no sign, no leading zeros)
-- ARGV[3]    '3' when the client speaks RESP3, '2' otherwise
-- ARGV[4..]  the original command and its arguments
--
-- Refuses with `FENCED <resource> token <n> is below fence <m>` when the stored fence is above
-- the token; otherwise raises the fence to the token (equal is accepted, rule 2) and returns the
-- wrapped command's reply unchanged (errors included, through redis.pcall).
-- Revisions go up to 2^63-1, beyond a Lua number's exact range, so they are compared as
-- canonical decimal strings: longer is larger, equal lengths compare as text.
local function fencegate_fence(keys, argv)
  local token = argv[2]
  local fence = redis.call('GET', keys[1])
  if fence and (#fence > #token or (#fence == #token and fence > token)) then
    return redis.error_reply('FENCED ' .. argv[1] .. ' token ' .. token .. ' is below fence ' .. fence)
  end
  if fence ~= token then
    redis.call('SET', keys[1], token)
  end
  if argv[3] == '3' then
    redis.setresp(3)
  end
  return redis.pcall(unpack(argv, 4))
end
