package idempotency

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// collidingPairs are (req_id, host, port) pairs whose keys were one key
// when req_id was written into the hash tag unescaped: P{R}:rec:D.
var collidingPairs = [][2]struct {
	reqID, host string
	port        int
}{
	// t:{x}:rec:y}:rec:h:1 both ways.
	{{"x}:rec:y", "h", 1}, {"x", "y}:rec:h", 1}},
	// t:{a}:claim:b}:...: a req_id that ends its own tag early.
	{{"a}:rec:10.0.0.1", "10.0.0.2", 40000}, {"a", "10.0.0.1}:rec:10.0.0.2", 40000}},
	// An escape-looking req_id must not meet the escape of another.
	{{"p%7D", "h", 1}, {"p}", "h", 1}},
}

// hashTag is the part of a key Redis Cluster hashes: what lies between the
// first '{' and the first '}' after it, when that is not empty.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}

// allKeys lists every key and channel the store names for k, by role.
func allKeys(r *Redis, k Key) map[string]string {
	ks := r.keys(k)
	return map[string]string{"rec": ks.rec, "claim": ks.claim, "claims": ks.claims, "dests": ks.dests,
		"counted": ks.counted, "count": ks.count, "rel": ks.rel, "done": ks.done}
}

// perDest are the roles named by destination as well as req_id.
var perDest = map[string]bool{"rec": true, "claim": true, "done": true}

// checkKeys asserts that the names of a and b are injective and that each
// req_id's names share one hash tag.
func checkKeys(t *testing.T, r *Redis, a, b Key) {
	t.Helper()
	ka, kb := allKeys(r, a), allKeys(r, b)
	for _, ks := range []map[string]string{ka, kb} {
		seen := map[string]string{}
		var tag *string
		for role, name := range ks {
			if other, dup := seen[name]; dup {
				t.Fatalf("%q names both %s and %s", name, role, other)
			}
			seen[name] = role
			if tg := hashTag(name); tag == nil {
				tag = &tg
			} else if *tag != tg {
				t.Fatalf("one req_id's keys hash apart: %q and tag %q", name, *tag)
			}
		}
	}
	for ra, na := range ka {
		for rb, nb := range kb {
			same := ra == rb && a.ReqID == b.ReqID && (!perDest[ra] || a.Dest == b.Dest)
			if (na == nb) != same {
				t.Fatalf("%s of %+v is %q, %s of %+v is %q", ra, a, na, rb, b, nb)
			}
		}
	}
	if a.ReqID != b.ReqID && hashTag(ka["rec"]) == hashTag(kb["rec"]) {
		t.Fatalf("req_ids %q and %q share the hash tag %q", a.ReqID, b.ReqID, hashTag(ka["rec"]))
	}
}

func TestRedisKeyNamesAreInjective(t *testing.T) {
	r := &Redis{prefix: "t:"}
	for _, p := range collidingPairs {
		checkKeys(t, r, NewKey(p[0].reqID, p[0].host, p[0].port), NewKey(p[1].reqID, p[1].host, p[1].port))
	}
	// Real req_ids keep their readable names.
	if got := r.keys(NewKey("9f1c_local_part_0", "10.0.0.1", 40000)).rec; got != "t:{9f1c_local_part_0}:rec:10.0.0.1:40000" {
		t.Errorf("rec key %q", got)
	}
}

// FuzzRedisKeys checks injectivity and the shared hash tag over arbitrary
// pairs of (req_id, host, port).
func FuzzRedisKeys(f *testing.F) {
	for _, p := range collidingPairs {
		f.Add(p[0].reqID, p[0].host, p[0].port, p[1].reqID, p[1].host, p[1].port)
	}
	f.Add("r", "h", 1, "r", "h", 2)
	f.Add("{r}", "h:1", 1, "{r}:", "h", 1)
	f.Add("%", "h", 1, "%25", "h", 1)
	r := &Redis{prefix: "encgate:"}
	f.Fuzz(func(t *testing.T, r1, h1 string, p1 int, r2, h2 string, p2 int) {
		// Ports are 1-65535 (the parser's bound); the key writes the number.
		p1, p2 = 1+abs(p1)%65535, 1+abs(p2)%65535
		checkKeys(t, r, NewKey(r1, h1, p1), NewKey(r2, h2, p2))
	})
}

func abs(n int) int {
	if n < 0 {
		return -(n + 1)
	}
	return n
}

// Through a real Redis: a /send whose key collided with another's under
// the old naming is forwarded, not "replayed" from the other's record.
func TestRedisCollidingKeysStayDistinct(t *testing.T) {
	testCollidingKeysStayDistinct(t, startServerShape(t))
}

func testCollidingKeysStayDistinct(t *testing.T, sh *redisShape) {
	st := newStoreOn(t, sh, redisOpts{})
	s := NewSends(st, DefaultConfig(), clock.Real{}, zap.NewNop(), NewMetrics(prometheus.NewRegistry(), nil))
	for i, p := range collidingPairs {
		forwards := 0
		fwd := func(time.Duration) (Answer, bool) {
			forwards++
			return Answer{Status: 200, ContentType: "application/json", Body: []byte(`"` + p[forwards-1].reqID + `"`)}, true
		}
		for j, side := range p {
			res := s.Do(bg, Send{Key: NewKey(side.reqID, side.host, side.port), ReceiveCount: 1}, time.Now().Add(hangGuard), fwd)
			if res.Outcome != Forwarded {
				t.Fatalf("pair %d side %d (%+v): %v, want forwarded", i, j, side, res.Outcome)
			}
		}
		for j, side := range p {
			rec, found, _, err := st.Lookup(bg, NewKey(side.reqID, side.host, side.port))
			if err != nil || !found || string(rec.Body) != `"`+side.reqID+`"` {
				t.Fatalf("pair %d side %d: record %q found=%v err=%v", i, j, rec.Body, found, err)
			}
		}
	}
}
