package fakeencoder

import (
	"context"
	"crypto/sha256"
	"fmt"
	"net/http"
	"testing"
	"time"
)

// rawEncodeBody is an /encode body for id whose mm_items value is the raw
// JSON text items, byte for byte.
func rawEncodeBody(id, items string) string {
	return fmt.Sprintf(`{"req_id":%q,"mm_items":%s,"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id, items)
}

// cacheOptions are testOptions with a media cache of n entries.
func cacheOptions(n int) Options {
	o := testOptions()
	o.CacheItems = n
	return o
}

// encodeOK posts an /encode and fails the test unless it answers 200.
func encodeOK(t *testing.T, e *Encoder, body string) reply {
	t.Helper()
	r := post(t, e, RouteEncode, body)
	if r.status != http.StatusOK {
		t.Fatalf("encode: %d %s", r.status, r.body)
	}
	return r
}

// expectCache checks the cache counters.
func expectCache(t *testing.T, e *Encoder, hits, misses int64) {
	t.Helper()
	if s := e.Stats(); s.CacheHits != hits || s.CacheMisses != misses {
		t.Fatalf("cache hits/misses %d/%d, want %d/%d", s.CacheHits, s.CacheMisses, hits, misses)
	}
}

func TestCacheMissThenHit(t *testing.T) {
	e := start(t, cacheOptions(8))
	encodeOK(t, e, rawEncodeBody("c1", `["img-a","img-b"]`))
	expectCache(t, e, 0, 1)
	encodeOK(t, e, rawEncodeBody("c2", `["img-a","img-b"]`))
	expectCache(t, e, 1, 1)
	encodeOK(t, e, rawEncodeBody("c3", `["img-c"]`))
	expectCache(t, e, 1, 2)
	// The key is the raw bytes: the same items written differently miss.
	encodeOK(t, e, rawEncodeBody("c4", `["img-a", "img-b"]`))
	expectCache(t, e, 1, 3)
	// A hit is an encode like any other: its metadata is published and its
	// state staged for the follow-ups.
	want := `{"req_id":"c2","part_idx":0,"embedding_size":1048576,"embedding_len":512,"embedding_dim":1024}`
	expect(t, post(t, e, RouteMetadata, metaBody("c2")), http.StatusOK, want)
	if s := e.Stats(); s.Staged != 4 {
		t.Fatalf("staged %d, want 4", s.Staged)
	}
}

func TestCacheEvictsLeastRecentlyUsed(t *testing.T) {
	e := start(t, cacheOptions(2))
	a, b, c := `["a"]`, `["b"]`, `["c"]`
	encodeOK(t, e, rawEncodeBody("e1", a)) // miss: [a]
	encodeOK(t, e, rawEncodeBody("e2", b)) // miss: [a b]
	encodeOK(t, e, rawEncodeBody("e3", a)) // hit: [b a]
	encodeOK(t, e, rawEncodeBody("e4", c)) // miss, evicts b: [a c]
	expectCache(t, e, 1, 3)
	encodeOK(t, e, rawEncodeBody("e5", a)) // hit: [c a]
	expectCache(t, e, 2, 3)
	encodeOK(t, e, rawEncodeBody("e6", b)) // miss, evicts c: [a b]
	expectCache(t, e, 2, 4)
	encodeOK(t, e, rawEncodeBody("e7", c)) // miss: c was evicted
	expectCache(t, e, 2, 5)
	if n := e.cache.len(); n != 2 {
		t.Fatalf("cache holds %d keys, want 2", n)
	}
}

func TestCacheHitSkipsEncodeLatency(t *testing.T) {
	opts := cacheOptions(4)
	opts.EncodeLatency = time.Hour // a miss never answers within the test
	entered := make(chan string, 4)
	opts.EncodeHook = func(_ context.Context, id string) { entered <- id }
	e := start(t, opts)
	// Seed the cache with the key a successful encode of ["img-a"] leaves:
	// the SHA-256 of the raw mm_items bytes.
	e.cache.add(sha256.Sum256([]byte(`["img-a"]`)))

	// The hit answers although EncodeLatency is an hour.
	encodeOK(t, e, rawEncodeBody("hit", `["img-a"]`))
	expectCache(t, e, 1, 0)
	if id := <-entered; id != "hit" {
		t.Fatalf("hook entered for %q", id)
	}

	// A miss pays the latency: it is held until its caller gives up, and an
	// encode that did not succeed is not cached.
	ctx, cancel := context.WithCancel(context.Background())
	miss := doAsync(ctx, e, http.MethodPost, RouteEncode, rawEncodeBody("miss", `["img-b"]`))
	select {
	case id := <-entered: // past the lookup, about to sleep EncodeLatency
		if id != "miss" {
			t.Fatalf("hook entered for %q", id)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the miss never reached the encode hook")
	}
	expectCache(t, e, 1, 1)
	waitWaiting(t, e, RouteEncode, 1)
	pending(t, miss, "a miss with an hour of EncodeLatency")
	cancel()
	if r := recv(t, miss); r.err == nil {
		t.Fatalf("the cancelled miss answered %d %s", r.status, r.body)
	}
	waitWaiting(t, e, RouteEncode, 0)
	if n := e.cache.len(); n != 1 {
		t.Fatalf("cache holds %d keys after an aborted miss, want 1", n)
	}
}

func TestCacheSkipsFailedEncodes(t *testing.T) {
	e := start(t, cacheOptions(4))
	// A model-forward failure looks the cache up (a miss) but is not cached.
	for _, id := range []string{"f1", "f2"} {
		expectErr(t, post(t, e, RouteEncode, rawEncodeBody(id, `["fail-encode:500:boom"]`)), http.StatusInternalServerError, "boom", id)
	}
	expectCache(t, e, 0, 2)
	// A preprocessing failure never reaches the cache.
	expectErr(t, post(t, e, RouteEncode, rawEncodeBody("p1", `["fail:400:bad image"]`)), http.StatusBadRequest, "bad image", "p1")
	expectCache(t, e, 0, 2)
	if n := e.cache.len(); n != 0 {
		t.Fatalf("cache holds %d keys, want 0", n)
	}
}

func TestCacheOffByDefault(t *testing.T) {
	e := start(t, testOptions())
	if e.cache != nil {
		t.Fatal("a cache without CacheItems")
	}
	encodeOK(t, e, rawEncodeBody("o1", `["img-a"]`))
	encodeOK(t, e, rawEncodeBody("o2", `["img-a"]`))
	expectCache(t, e, 0, 0)
}

func TestCacheResetStats(t *testing.T) {
	e := start(t, cacheOptions(4))
	encodeOK(t, e, rawEncodeBody("r1", `["img-a"]`))
	encodeOK(t, e, rawEncodeBody("r2", `["img-a"]`))
	expectCache(t, e, 1, 1)
	e.ResetStats()
	expectCache(t, e, 0, 0)
	// The cache itself survives a stats reset.
	encodeOK(t, e, rawEncodeBody("r3", `["img-a"]`))
	expectCache(t, e, 1, 0)
}
