package fakeencoder

import (
	"crypto/sha256"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/encgate/encgate/internal/jsonfield"
)

// The media cache imitates sglang's --enable-prefix-mm-cache
// (Options.CacheItems): an encoder that has seen a part's media before
// answers its /encode without running the model again. In the fake a hit
// skips Options.EncodeLatency and nothing else, so a test can tell a
// cache-aware route (the same media sent to the same encoder) from one that
// is not by the latency its callers see and the counters in Stats.

// mediaKey is the cache key: the SHA-256 of the raw bytes of a body's
// mm_items value.
type mediaKey [sha256.Size]byte

// mediaCache is an LRU set of media keys; nil when caching is off. It is
// safe for concurrent use (the LRU has its own lock).
type mediaCache struct {
	lru *lru.Cache[mediaKey, struct{}]
}

// newMediaCache returns a cache of up to n keys, or nil when n <= 0.
func newMediaCache(n int) *mediaCache {
	if n <= 0 {
		return nil
	}
	c, err := lru.New[mediaKey, struct{}](n)
	if err != nil { // only for n <= 0, excluded above
		panic(err)
	}
	return &mediaCache{lru: c}
}

// keyOf hashes the raw bytes of the body's mm_items value exactly as they
// appear in the body (whitespace and escapes included): equal bytes are the
// same media. A body that the strict scanner refuses but fastjson parsed
// falls back to the re-marshalled value, which is still deterministic.
func keyOf(req *request) mediaKey {
	var raw [1][]byte
	if jsonfield.Lookup(req.body, []string{"mm_items"}, raw[:]) == nil && raw[0] != nil {
		return sha256.Sum256(raw[0])
	}
	if v := req.field("mm_items"); v != nil {
		return sha256.Sum256(marshalValue(nil, v))
	}
	return sha256.Sum256(nil)
}

// get reports whether k is cached, making it the most recently used.
func (c *mediaCache) get(k mediaKey) bool {
	_, ok := c.lru.Get(k)
	return ok
}

// add caches k, evicting the least recently used key when full.
func (c *mediaCache) add(k mediaKey) { c.lru.Add(k, struct{}{}) }

// len is the number of cached keys.
func (c *mediaCache) len() int { return c.lru.Len() }

// cacheLookup looks req's media up when caching is on, counting a hit or a
// miss. cached reports a hit; add reports a miss whose key should be cached
// once the encode succeeded.
func (e *Encoder) cacheLookup(req *request) (k mediaKey, cached, add bool) {
	if e.cache == nil {
		return k, false, false
	}
	k = keyOf(req)
	cached = e.cache.get(k)
	e.mu.Lock()
	if cached {
		e.stats.cacheHits++
	} else {
		e.stats.cacheMisses++
	}
	e.mu.Unlock()
	return k, cached, !cached
}
