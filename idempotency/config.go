// Package idempotency makes a repeated /send invisible: exactly one /send per
// (req_id, destination) reaches the encoder and every caller gets that one
// answer. Concurrent duplicates coalesce on the first, later ones replay the
// stored answer, a key reused with a different payload is refused, and once
// receive_count distinct destinations are done the req_id is released.
package idempotency

import (
	"github.com/encgate/encgate/internal/configfile"
)

// Config is the `idempotency:` section of the gateway config.
type Config struct {
	// Store is memory (one gateway) or redis (several replicas share it).
	Store string `yaml:"store"`
	// Capacity bounds the records the memory store holds (default 1,000,000);
	// past it the req_ids nearest to expiry are dropped, counted in a metric.
	// It counts records (destinations), not req_ids, so one req_id never
	// holds more than Capacity of them either: its destinations are bounded
	// by the smaller of Capacity and MaxDestinationsPerReqID.
	Capacity int `yaml:"capacity"`
	// MaxDestinationsPerReqID bounds the distinct destinations one req_id
	// may have, done and in flight together, in either store (default 1024).
	// A /send to one more is refused with a 400 envelope naming the bound
	// before it reaches the encoder, and counted. A req_id has one
	// destination per receiver TP rank (16 at most in practice), so only a
	// broken or hostile client comes near it; without the bound one req_id
	// could grow without limit, its records held while it lives.
	MaxDestinationsPerReqID int `yaml:"max_destinations_per_req_id"`
	// TTL is how long a req_id's records and release state are kept after its
	// last /send (default 10m).
	TTL configfile.Duration `yaml:"ttl"`
	// ClaimTTL bounds how long one replica may hold a key while its /send is
	// in flight (default 5m); the /send exchange is cut off before it. It
	// only matters for the redis store, where a crashed replica's claim must
	// not block the key forever. A replica whose answer Redis refuses to
	// store keeps extending its claim while it retries (for up to TTL), so
	// the key is not forwarded again meanwhile; a Redis that refuses even
	// that (read-only) for longer than ClaimTTL lets the claim lapse
	// (encgate_idempotency_complete_lost_total{reason="claim_lost"}).
	ClaimTTL configfile.Duration `yaml:"claim_ttl"`
	// MaxOrphanedClaims bounds the claims a replica keeps to end once Redis
	// answers again (default 65536): claims that a Claim whose reply was
	// lost, or an Abandon that failed, may have left, with nothing forwarded
	// under them. The replica ends each one as soon as Redis answers, and
	// its own retry of the /send takes it over at once. Past the bound, a
	// claim is left to expire with ClaimTTL. Only the redis store uses it.
	MaxOrphanedClaims int `yaml:"max_orphaned_claims"`
	// FailOpen forwards /sends without dedupe while Redis is unreachable
	// (counted in encgate_idempotency_fail_open_total). Off by default: the
	// caller then gets a 503 envelope and nothing is forwarded. Read with
	// store: redis, which reaches Redis through the top-level redis: section.
	FailOpen bool `yaml:"fail_open"`
	// MovedRedis is the old idempotency.redis section; its connection keys
	// are now the top-level redis: section, fail_open is idempotency.fail_open.
	MovedRedis configfile.Moved `yaml:"redis,omitempty"`
}

// maxDestinationsLimit is the largest max_destinations_per_req_id: a
// req_id's destination count is an int32 in the memory store, and the Redis
// claim script counts them one by one.
const maxDestinationsLimit = 1 << 16

// maxOrphanedClaimsLimit is the largest max_orphaned_claims: the resolver
// goes over them all on every pass.
const maxOrphanedClaimsLimit = 1 << 24

// DefaultConfig returns the idempotency defaults.
func DefaultConfig() Config {
	return Config{
		Store:    "memory",
		Capacity: 1_000_000,
		// 64x the largest receiver TP sglang runs (16): far from any real
		// req_id, small enough that one req_id's records stay cheap.
		MaxDestinationsPerReqID: 1024,
		TTL:                     configfile.Duration(600e9),
		ClaimTTL:                configfile.Duration(300e9),
		// Each kept claim costs about 200 bytes: 13 MiB at most, and only
		// while Redis is unreachable.
		MaxOrphanedClaims: 1 << 16,
	}
}

// Validate checks the section; path is its field path.
func (c Config) Validate(p *configfile.Problems, path string) {
	switch c.Store {
	case "memory", "redis":
	default:
		p.Addf(path+".store", "must be memory or redis, got %q", c.Store)
	}
	if c.Capacity < 1 {
		p.Addf(path+".capacity", "must be >= 1, got %d", c.Capacity)
	}
	if c.MaxDestinationsPerReqID < 1 || c.MaxDestinationsPerReqID > maxDestinationsLimit {
		p.Addf(path+".max_destinations_per_req_id", "must be between 1 and %d, got %d", maxDestinationsLimit, c.MaxDestinationsPerReqID)
	}
	p.Positive(path+".ttl", c.TTL)
	p.Positive(path+".claim_ttl", c.ClaimTTL)
	if c.MaxOrphanedClaims < 1 || c.MaxOrphanedClaims > maxOrphanedClaimsLimit {
		p.Addf(path+".max_orphaned_claims", "must be between 1 and %d, got %d", maxOrphanedClaimsLimit, c.MaxOrphanedClaims)
	}
	if c.MovedRedis.Set() {
		p.Addf(path+".redis", "has moved: the connection (addr, username, password_file, db, key_prefix, timeouts, pool_size, poll_interval) is the top-level redis: section, shared by every Redis user, and fail_open is %s.fail_open", path)
	}
}
