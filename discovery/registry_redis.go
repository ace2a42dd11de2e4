package discovery

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// registryKeySuffix names the sorted set of registrations under the prefix.
// It is the name the registry has always used, so replicas of an older
// version, during a rolling upgrade, share the set with newer ones (see
// NewRedisStore).
const registryKeySuffix = "bootstrap:encoders"

// registryChecksSuffix names, after the set's key, the sorted set of the
// registrations' health facts (see registryScriptHead). Every script
// touches both keys, so the second is given a hash tag that puts it in the
// first one's slot (sameSlotKey): each script stays within one hash slot,
// as Redis Cluster requires.
const registryChecksSuffix = ":checks"

// registryKeyGrace is how long the key outlives its latest expiry. The key's
// own expiry is relative (PEXPIRE); it only keeps an abandoned key from
// staying forever.
const registryKeyGrace = 60 * time.Second

// registryPassed is the offset of a passed check's score in the checks set
// (2^43 ms, about 278 years): a score below it is the registration time of
// a URL that never passed, a score above it this offset plus the time of
// its last passed check, so that one set orders both kinds of victim.
// Scores stay below 2^53, exact in a double.
const registryPassed = int64(1) << 43

// registryScriptHead starts every script: it reads Redis's clock (TIME; a
// script may write after it, as scripts are replicated by their effects
// since Redis 5) into now (unix ms) and defines the helpers.
//
// The set's scores: a registration's is its expiry (unix ms, > 0), as it
// always was; an unregistered URL's tombstone is the negated expiry of the
// tombstone (< 0). A URL is one member, so it is either registered or
// unregistered, and one ZSCORE tells which. Older replicas read a negative
// score as an expired registration, and drop it at their next add.
//
// The checks set (KEYS[2]) holds, for each live registration that a
// replica of this version wrote, its registration time (unix ms) while it
// has never passed a health check, and registryPassed plus the time of its
// last passed check (its last refresh) after. Its first member is Room's
// first victim. A member whose URL is not live any more (an older replica
// swept it) is dropped when it is met.
//
// sweep drops expired registrations (0 < score <= now), with their checks,
// and tombstones (-now <= score < 0). keep moves the keys' own expiry to
// grace past the latest expiry the set holds. tomb replaces a URL's
// registration by a tombstone, keeping at most max of them (tombstones sort
// before registrations, the most negative, latest expiring, first, so the
// one expiring first is the last of them). int formats a number as an
// integer (a Lua number as an argument may be sent in exponent form).
var registryScriptHead = `
local key = KEYS[1]
local checks = KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local passed = ` + strconv.FormatInt(registryPassed, 10) + `
local function int(x) return string.format('%d', x) end
local function sweep()
  local old = redis.call('ZRANGEBYSCORE', key, '(0', int(now))
  for i = 1, #old do redis.call('ZREM', checks, old[i]) end
  redis.call('ZREMRANGEBYSCORE', key, int(-now), int(now))
end
local function keep(grace)
  local last = 0
  local hi = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if hi[2] and tonumber(hi[2]) > 0 then last = tonumber(hi[2]) - now end
  local lo = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if lo[2] and tonumber(lo[2]) < 0 and -tonumber(lo[2]) - now > last then last = -tonumber(lo[2]) - now end
  if last < 1 then last = 1 end
  redis.call('PEXPIRE', key, int(last + grace))
  redis.call('PEXPIRE', checks, int(last + grace))
end
local function live()
  return redis.call('ZCOUNT', key, '(' .. int(now), '+inf')
end
local function tomb(u, ttl, max)
  local s = redis.call('ZSCORE', key, u)
  if not (s and tonumber(s) < 0) then
    local n = redis.call('ZCOUNT', key, '-inf', '(0')
    if n >= max then
      redis.call('ZREMRANGEBYRANK', key, n - 1, n - 1)
    end
  end
  redis.call('ZADD', key, int(-(now + ttl)), u)
  redis.call('ZREM', checks, u)
end
`

// registryAddScript registers a URL for a TTL, in one step so that replicas
// cannot both pass the bound. A URL that is live keeps its registration
// time. One that is not, while max are live, takes the place of Room's
// first victim in the checks set, which gets a tombstone. It returns
// {1, victim or "", reason} when stored (reason an EvictReason, 0 for
// none), {0, "", unchecked} when full: unchecked counts the registrations
// still in their grace.
//
// KEYS[1] the set, KEYS[2] the checks; ARGV[1] url, ARGV[2] ttl (ms),
// ARGV[3] max, ARGV[4] key grace (ms), ARGV[5] Room.Window (ms; 0: no room).
var registryAddScript = redis.NewScript(registryScriptHead + `
sweep()
local url, ttl, max, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local s = redis.call('ZSCORE', key, url)
if s and tonumber(s) > 0 then
  redis.call('ZADD', key, int(now + ttl), url)
  redis.call('ZADD', checks, 'NX', int(now), url)
  keep(tonumber(ARGV[4]))
  return {1, '', 0}
end
local victim, why = '', 0
if live() >= max then
  if window <= 0 then return {0, '', 0} end
  local cut = now - window
  local function first(lo, hi)
    while true do
      local c = redis.call('ZRANGEBYSCORE', checks, lo, hi, 'LIMIT', 0, 1)
      if #c == 0 then return nil end
      local v = redis.call('ZSCORE', key, c[1])
      if v and tonumber(v) > now then return c[1] end
      redis.call('ZREM', checks, c[1])
    end
  end
  local c = first('-inf', int(cut))
  if c then
    victim, why = c, 1
  else
    c = first(int(passed), int(passed + cut))
    if c then victim, why = c, 2 end
  end
  if victim == '' then
    return {0, '', redis.call('ZCOUNT', checks, '(' .. int(cut), '(' .. int(passed))}
  end
  tomb(victim, ttl, max)
end
redis.call('ZADD', key, int(now + ttl), url)
redis.call('ZADD', checks, int(now), url)
keep(tonumber(ARGV[4]))
return {1, victim, why}
`)

// registryRefreshScript moves the expiry of the live URLs to now+ttl and
// adds back those the set lacks, unless they have a tombstone or max are
// live. The tombstone check and the write are one step, so a refresh racing
// an unregistration on another replica cannot bring the URL back. Each URL
// extended or added back has passed a health check now. It returns one
// outcome per URL, RefreshOutcome's values.
//
// KEYS[1] the set, KEYS[2] the checks; ARGV[1] ttl (ms), ARGV[2] max,
// ARGV[3] key grace (ms), ARGV[4...] the URLs.
var registryRefreshScript = redis.NewScript(registryScriptHead + `
sweep()
local exp = now + tonumber(ARGV[1])
local max = tonumber(ARGV[2])
local n = live()
local out = {}
for i = 4, #ARGV do
  local s = redis.call('ZSCORE', key, ARGV[i])
  if s then s = tonumber(s) end
  if s and s < 0 then
    out[#out + 1] = 2
  elseif s then
    if s < exp then redis.call('ZADD', key, int(exp), ARGV[i]) end
    redis.call('ZADD', checks, int(passed + now), ARGV[i])
    out[#out + 1] = 0
  elseif n < max then
    redis.call('ZADD', key, int(exp), ARGV[i])
    redis.call('ZADD', checks, int(passed + now), ARGV[i])
    n = n + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 3
  end
end
keep(tonumber(ARGV[3]))
return out
`)

// registryRemoveScript replaces a URL's registration (if any) by a tombstone
// that expires after ttl. Past max tombstones, the one that would expire
// first makes room.
//
// KEYS[1] the set, KEYS[2] the checks; ARGV[1] url, ARGV[2] ttl (ms),
// ARGV[3] max, ARGV[4] key grace (ms).
var registryRemoveScript = redis.NewScript(registryScriptHead + `
sweep()
tomb(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]))
keep(tonumber(ARGV[4]))
return 1
`)

// registryListScript reads, without writing, the live URLs with their time
// left (ms) and the URLs with a tombstone, by Redis's clock.
//
// KEYS[1] the set, KEYS[2] the checks (unread).
var registryListScript = redis.NewScript(registryScriptHead + `
local live = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES')
local out = {}
for i = 1, #live, 2 do
  out[#out + 1] = live[i]
  out[#out + 1] = int(tonumber(live[i + 1]) - now)
end
return {out, redis.call('ZRANGEBYSCORE', key, '-inf', '(' .. int(-now))}
`)

// NewRedisStore returns a Store shared by every gateway replica using
// client and prefix, so a registration on one is seen by all. It keeps one
// sorted set, prefix+"bootstrap:encoders": member = URL, score = expiry in
// unix milliseconds for a registration, the negated expiry of its tombstone
// for an unregistered URL; and beside it the registrations' health facts
// (registryScriptHead), prefix+"bootstrap:encoders:checks" with a hash tag
// that puts it in the first key's slot. Every read and write is a script
// that takes the time from Redis (TIME), so the replicas' clocks play no
// part in expiry, nor in a registration's grace.
//
// The first key and the registrations' scores are those of earlier
// versions, so during a rolling upgrade old and new replicas share one set.
// An old replica sees a tombstone as an expired registration: it lists it
// nowhere, and its next registration removes it (with every other expired
// member), so until the upgrade is done an unregistration may be
// re-asserted by a new replica that still serves it after an old replica
// registered something. A registration an old replica wrote has no health
// facts until a new replica refreshes it or it registers again, and is no
// victim until then.
func NewRedisStore(client redis.UniversalClient, prefix string) Store {
	key := prefix + registryKeySuffix
	return &redisStore{c: client, keys: []string{key, sameSlotKey(key, registryChecksSuffix)}}
}

// redisStore is the Redis Store.
type redisStore struct {
	c    redis.UniversalClient
	keys []string // the set, the checks
}

func (s *redisStore) Add(ctx context.Context, url string, ttl time.Duration, room Room) (AddResult, error) {
	v, err := registryAddScript.Run(ctx, s.c, s.keys,
		url, ttl.Milliseconds(), room.Max, registryKeyGrace.Milliseconds(), max(room.Window, 0).Milliseconds()).Slice()
	if err != nil {
		return AddResult{}, fmt.Errorf("redis: %w", err)
	}
	var (
		stored, n   int64
		victim      string
		ok1, ok2    bool
		okv         = len(v) == 3
		unexpectedf = func() (AddResult, error) {
			return AddResult{}, fmt.Errorf("redis: unexpected add reply %v", v)
		}
	)
	if okv {
		stored, ok1 = v[0].(int64)
		victim, ok2 = v[1].(string)
		n, okv = v[2].(int64)
	}
	if !okv || !ok1 || !ok2 {
		return unexpectedf()
	}
	switch {
	case stored == 0:
		return AddResult{}, &FullError{Max: room.Max, Unchecked: int(n), Window: max(room.Window, 0)}
	case victim == "":
		return AddResult{}, nil
	case n != int64(EvictNeverPassed) && n != int64(EvictFailing):
		return unexpectedf()
	}
	return AddResult{Evicted: victim, Reason: EvictReason(n)}, nil
}

func (s *redisStore) Refresh(ctx context.Context, urls []string, ttl time.Duration, max int) ([]RefreshOutcome, error) {
	if len(urls) == 0 {
		return nil, nil
	}
	args := make([]any, 0, 3+len(urls))
	args = append(args, ttl.Milliseconds(), max, registryKeyGrace.Milliseconds())
	for _, u := range urls {
		args = append(args, u)
	}
	codes, err := registryRefreshScript.Run(ctx, s.c, s.keys, args...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	if len(codes) != len(urls) {
		return nil, fmt.Errorf("redis: refresh answered %d outcomes for %d urls", len(codes), len(urls))
	}
	out := make([]RefreshOutcome, len(codes))
	for i, c := range codes {
		if c < int64(RefreshExtended) || c > int64(RefreshFull) {
			return nil, fmt.Errorf("redis: refresh answered outcome %d", c)
		}
		out[i] = RefreshOutcome(c)
	}
	return out, nil
}

func (s *redisStore) Remove(ctx context.Context, url string, ttl time.Duration, max int) error {
	err := registryRemoveScript.Run(ctx, s.c, s.keys,
		url, ttl.Milliseconds(), max, registryKeyGrace.Milliseconds()).Err()
	if err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	return nil
}

func (s *redisStore) List(ctx context.Context) (Listing, error) {
	v, err := registryListScript.Run(ctx, s.c, s.keys).Slice()
	if err != nil {
		return Listing{}, fmt.Errorf("redis: %w", err)
	}
	bad := func(what string) (Listing, error) {
		return Listing{}, fmt.Errorf("redis: unexpected list reply: %s", what)
	}
	if len(v) != 2 {
		return bad("not two arrays")
	}
	live, ok1 := v[0].([]any)
	gone, ok2 := v[1].([]any)
	if !ok1 || !ok2 || len(live)%2 != 0 {
		return bad("not two arrays")
	}
	var l Listing
	for i := 0; i < len(live); i += 2 {
		u, ok := live[i].(string)
		left, ok2 := live[i+1].(string)
		ms, err := strconv.ParseInt(left, 10, 64)
		if !ok || !ok2 || err != nil || ms <= 0 {
			return bad("a live member without its time left")
		}
		l.Live = append(l.Live, Lease{URL: u, Left: time.Duration(ms) * time.Millisecond})
	}
	for _, g := range gone {
		u, ok := g.(string)
		if !ok {
			return bad("a tombstone that is not a string")
		}
		l.Gone = append(l.Gone, u)
	}
	sort.Slice(l.Live, func(i, j int) bool { return l.Live[i].URL < l.Live[j].URL })
	sort.Strings(l.Gone)
	return l, nil
}

// sameSlotKey returns key+suffix when key has a Redis Cluster hash tag (so
// the two share it), else key+suffix+"{tag}" with the shortest decimal tag
// that hashes to key's slot: every replica derives the same name, and a
// script given both keys stays within one slot.
func sameSlotKey(key, suffix string) string {
	if hashTag(key) != key {
		return key + suffix
	}
	slot := clusterSlot(key)
	for i := 0; ; i++ {
		tag := strconv.Itoa(i)
		if clusterSlot(tag) == slot {
			return key + suffix + "{" + tag + "}"
		}
	}
}

// hashTag is the part of key that Redis Cluster hashes: the text of its
// first non-empty {...}, else the whole key.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

// clusterSlot is key's Redis Cluster slot: CRC16 (XMODEM) of its hash tag,
// mod 16384.
func clusterSlot(key string) uint16 {
	var crc uint16
	for _, b := range []byte(hashTag(key)) {
		crc ^= uint16(b) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc % 16384
}
