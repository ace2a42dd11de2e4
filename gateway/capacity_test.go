package gateway

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/upstream"
)

// The Redis a flow costs: one multimodal part as sglang makes it, its
// /encode, its metadata pull, a GEN0 registration, one /send per receiver
// rank and a replay of each. bench/capacity.sh writes the table this test
// measures (ENCGATE_CAPACITY_OUT) into bench/results/capacity.md.

// capacityOutEnv names the file TestRedisRoundTripsPerFlow writes its table
// to (markdown rows), when set.
const capacityOutEnv = "ENCGATE_CAPACITY_OUT"

// flowRig is two gateway replicas on one loopback Redis, each with its
// own counting hook, in front of two fake encoders reached through a proxy
// that notes, as each /send reaches an encoder, how many round trips the
// replicas had made by then.
type flowRig struct {
	t     *testing.T
	gws   [2]*gw
	ops   [2]*redisOps
	mu    sync.Mutex
	atFwd []int // round trips of both replicas so far, at each /send's arrival
}

func newFlowRig(t *testing.T) *flowRig {
	t.Helper()
	rd := redistest.Start(t)
	r := &flowRig{t: t}
	var urls []string
	for _, e := range startFakes(t, 2, nil) {
		urls = append(urls, r.watchSends(e.URL()))
	}
	for i := range r.gws {
		r.ops[i] = &redisOps{}
		cfg := DefaultConfig()
		cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
		for j, u := range urls {
			cfg.Encoders = append(cfg.Encoders, upstream.EncoderConfig{Name: fmt.Sprintf("enc-%d", j), URL: u})
		}
		cfg.Idempotency.Store = "redis"
		cfg.Redis.Addr = rd.Addr()
		cfg.Health.Disabled = true
		// A follow-up that waited for a pin it should have found would
		// hang: none may wait.
		cfg.Affinity.UnknownWait = configfile.Duration(time.Hour)
		s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), RedisHook: r.ops[i],
			Rand: func() float64 { return 0 }})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Shutdown(t.Context()) })
		r.gws[i] = &gw{Server: s, base: "http://" + s.Addr()}
	}
	// Both replicas' subscriptions to the placement channel are made in
	// the background; their connections' setup would count against the
	// first calls.
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer rc.Close()
	channel := DefaultConfig().Redis.KeyPrefix + "pins:placed"
	eventually(t, "both replicas subscribed to "+channel, func() bool {
		n, err := rc.PubSubNumSub(t.Context(), channel).Result()
		return err == nil && n[channel] == 2
	})
	for _, o := range r.ops {
		o.take() // New's check that Redis answers, the subscriptions' setup
	}
	return r
}

// watchSends returns the URL of a proxy to target that records, for every
// /send, the replicas' round trips at the moment it arrives.
func (r *flowRig) watchSends(target string) string {
	u, err := url.Parse(target)
	if err != nil {
		r.t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == routeSend {
			n := 0
			for _, o := range r.ops {
				n += o.count()
			}
			r.mu.Lock()
			r.atFwd = append(r.atFwd, n)
			r.mu.Unlock()
		}
		rp.ServeHTTP(w, req)
	}))
	r.t.Cleanup(srv.Close)
	return srv.URL
}

// step is one call of a flow and what it cost in Redis.
type step struct {
	what      string // the call, as the table names it
	replica   int    // 0 (A, the /encode's) or 1 (B)
	ops       opsTaken
	beforeFwd int // round trips before the call reached an encoder with a /send; -1 when none did
}

// call posts body to route on replica at; the answer must be 200. Only
// that replica may have talked to Redis meanwhile.
func (r *flowRig) call(at int, what, route, body string) step {
	r.t.Helper()
	r.mu.Lock()
	fwd := len(r.atFwd)
	r.mu.Unlock()
	start := r.ops[0].count() + r.ops[1].count()
	a := post(r.t, r.gws[at].base+route, body)
	if a.status != http.StatusOK {
		r.t.Fatalf("%s on replica %c: %d %s", what, 'A'+at, a.status, a.body)
	}
	s := step{what: what, replica: at, ops: r.ops[at].take(), beforeFwd: -1}
	if other := r.ops[1-at].take(); other.rtts() != 0 {
		r.t.Fatalf("%s on replica %c: the other replica talked to Redis meanwhile: %v", what, 'A'+at, other.trips)
	}
	r.mu.Lock()
	if len(r.atFwd) > fwd {
		s.beforeFwd = r.atFwd[fwd] - start
	}
	r.mu.Unlock()
	return s
}

// flow runs one part: its /encode on replica A, its metadata pull and a
// GEN0 registration on replica pull, the /send of each of tp ranks on
// replica send, then each /send again there (replays), then each again on
// the other replica.
func (r *flowRig) flow(id string, tp, pull, send int) []step {
	r.t.Helper()
	steps := []step{
		r.call(0, "/encode", routeEncode, encodeBody(id)),
		r.call(pull, "metadata pull", routeMetadata, metaBody(id)),
		r.call(pull, "registration (GEN0 /scheduler_receive_url)", "/scheduler_receive_url", registerBody(id, "10.0.0.1:5000", tp)),
	}
	for rank := range tp {
		steps = append(steps, r.call(send, "/send, first time", routeSend, tpSend(id, rank, tp)))
	}
	for rank := range tp {
		steps = append(steps, r.call(send, "/send, replayed", routeSend, tpSend(id, rank, tp)))
	}
	for rank := range tp {
		steps = append(steps, r.call(1-send, "/send, replayed on the other replica", routeSend, tpSend(id, rank, tp)))
	}
	return steps
}

// TestRedisRoundTripsPerFlow counts, with a redis.Hook on each replica's
// client, the Redis round trips of every call of a flow, and holds them to
// the targets:
//
//   - a first-time /send: one round trip before it is forwarded (the claim
//     script, which also answers a stored record or a release), one after
//     (the complete script, which stores the answer);
//   - a replayed /send: one (the claim script answers the record);
//   - a follow-up on a replica holding the req_id's pin: no pin read; on a
//     replica without it: one (HGETALL), and none after that there;
//   - an /encode: two (the pin placed, the pin encoded).
//
// With ENCGATE_CAPACITY_OUT set it writes the measured table there
// (bench/capacity.sh).
func TestRedisRoundTripsPerFlow(t *testing.T) {
	r := newFlowRig(t)
	// The first flow on a fresh Redis: every script is sent whole once (its
	// EVALSHA answered NOSCRIPT, then EVAL) and the pool dials.
	first := r.flow("capacity-first_local_part_0", 2, 0, 0)
	var cold opsTaken
	for _, s := range first {
		cold.cmds += s.ops.cmds
		cold.loads += s.ops.loads
		cold.miss += s.ops.miss
		cold.dials += s.ops.dials
		cold.trips = append(cold.trips, s.ops.trips...)
	}
	// The same flow, warm, on both replicas (B dials and loads nothing new:
	// the scripts are in Redis now).
	_ = r.flow("capacity-warm_local_part_0", 2, 1, 1)

	type flowRun struct {
		name  string
		tp    int
		steps []step
	}
	var runs []flowRun
	for _, tp := range []int{2, 8} {
		for _, sc := range []struct {
			name       string
			pull, send int
		}{
			{"all on A (its /encode's replica)", 0, 0},
			{"pull and /sends on B (another replica)", 1, 1},
			{"pull on A, /sends on B", 0, 1},
		} {
			id := fmt.Sprintf("capacity-tp%d-%c%c_local_part_0", tp, 'A'+sc.pull, 'A'+sc.send)
			runs = append(runs, flowRun{fmt.Sprintf("TP=%d, %s", tp, sc.name), tp, r.flow(id, tp, sc.pull, sc.send)})
		}
	}

	if out := os.Getenv(capacityOutEnv); out != "" {
		var b strings.Builder
		writeSummary(&b, runs[0].steps, runs[1].steps, runs[2].steps, func(tp int) (local, other int) {
			for _, fr := range runs {
				if fr.tp != tp {
					continue
				}
				n := 0
				for _, s := range fr.steps {
					if !strings.HasPrefix(s.what, "/send, replayed") {
						n += s.ops.rtts()
					}
				}
				if fr.steps[1].replica == 0 && fr.steps[3].replica == 0 {
					local = n
				} else {
					other = max(other, n)
				}
			}
			return local, other
		})
		fmt.Fprintf(&b, "\nEvery call, as measured:\n\n")
		fmt.Fprintf(&b, "| flow | call | on | round trips | of them before the forward | Redis commands | what is sent, in order |\n")
		fmt.Fprintf(&b, "|---|---|---|---:|---:|---:|---|\n")
		for _, fr := range runs {
			name := fr.name
			for i := 0; i < len(fr.steps); {
				s := fr.steps[i]
				n := 1
				for i+n < len(fr.steps) && fr.steps[i+n].what == s.what && fr.steps[i+n].replica == s.replica &&
					slices.Equal(fr.steps[i+n].ops.trips, s.ops.trips) && fr.steps[i+n].beforeFwd == s.beforeFwd {
					n++
				}
				what := s.what
				if n > 1 {
					what = fmt.Sprintf("%s (x%d, each)", what, n)
				}
				before := "-"
				if s.beforeFwd >= 0 {
					before = fmt.Sprint(s.beforeFwd)
				}
				sent := strings.Join(s.ops.trips, ", ")
				if sent == "" {
					sent = "nothing"
				}
				fmt.Fprintf(&b, "| %s | %s | %c | %d | %s | %d | %s |\n", name, what, 'A'+s.replica, s.ops.rtts(), before, s.ops.cmds, sent)
				i += n
			}
			tot, rep := 0, 0
			for _, s := range fr.steps {
				if strings.HasPrefix(s.what, "/send, replayed") {
					rep += s.ops.rtts()
				} else {
					tot += s.ops.rtts()
				}
			}
			fmt.Fprintf(&b, "| %s | **the flow** (/encode, pull, registration, %d first-time /sends) | | **%d** | | | (replays above: %d more) |\n", name, fr.tp, tot, rep)
		}
		fmt.Fprintf(&b, "\nFirst flow on a fresh Redis (TP=2, all on A): %d round trips, %d commands; %d EVALSHA answered NOSCRIPT, %d scripts sent whole (EVAL), %d connections dialed.\n",
			cold.rtts(), cold.cmds, cold.miss, cold.loads, cold.dials)
		if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	for _, fr := range runs {
		hasPin := [2]bool{true, false} // A placed it
		for _, s := range fr.steps {
			// A call routed to the encoder reads the pin where this replica
			// has none (and keeps it); a replay reads none.
			read := !hasPin[s.replica] && !strings.HasPrefix(s.what, "/send, replayed")
			if read {
				hasPin[s.replica] = true
			}
			want := wantTrips(s.what, read)
			if !slices.Equal(s.ops.trips, want) {
				t.Errorf("%s: %s on %c: round trips %q, want %q", fr.name, s.what, 'A'+s.replica, s.ops.trips, want)
			}
			if s.ops.loads != 0 || s.ops.dials != 0 {
				t.Errorf("%s: %s: %d script loads, %d dials in a warm flow", fr.name, s.what, s.ops.loads, s.ops.dials)
			}
			// Before the forward: the claim, and the pin read if there was one.
			if wantBefore := 1 + len(want) - 2; s.what == "/send, first time" && s.beforeFwd != wantBefore {
				t.Errorf("%s: a first-time /send on %c made %d round trips before it was forwarded, want %d",
					fr.name, 'A'+s.replica, s.beforeFwd, wantBefore)
			}
			if strings.HasPrefix(s.what, "/send, replayed") && s.beforeFwd >= 0 {
				t.Errorf("%s: %s reached the encoder", fr.name, s.what)
			}
		}
	}
}

// writeSummary writes the per-store table: what each kind of call costs,
// from the TP=2 flows all on A (local), with pull and /sends on B (pulled),
// and with the pull on A and the /sends on B (sent); flow gives a whole
// flow's round trips for a TP, all on A and at most elsewhere.
func writeSummary(b *strings.Builder, local, pulled, sent []step, flow func(tp int) (local, other int)) {
	find := func(steps []step, what string) step {
		for _, s := range steps {
			if s.what == what {
				return s
			}
		}
		return step{beforeFwd: -1}
	}
	row := func(call string, s step) {
		before := ""
		if s.beforeFwd >= 0 {
			before = fmt.Sprintf(" (%d before the forward)", s.beforeFwd)
		}
		sent := strings.Join(s.ops.trips, ", ")
		if sent == "" {
			sent = "nothing"
		}
		fmt.Fprintf(b, "| %s | 0 | %d%s | %s |\n", call, s.ops.rtts(), before, sent)
	}
	fmt.Fprintf(b, "| call | memory store: round trips | Redis store: round trips | Redis: what is sent |\n|---|---:|---|---|\n")
	row("`/encode`", find(local, "/encode"))
	row("metadata pull or GEN0 registration, on a replica holding the pin", find(local, "metadata pull"))
	row("metadata pull or GEN0 registration, on a replica without the pin (first follow-up of the part there)", find(pulled, "metadata pull"))
	row("first-time `/send`, pin on this replica", find(local, "/send, first time"))
	row("first-time `/send`, first follow-up of the part on this replica", find(sent, "/send, first time"))
	row("replayed `/send`, any replica", find(local, "/send, replayed"))
	for _, tp := range []int{2, 8} {
		l, o := flow(tp)
		fmt.Fprintf(b, "| **a flow, TP=%d**: `/encode`, pull, registration, %d first-time `/send`s | 0 | **%d** all on the `/encode`'s replica; %d with the follow-ups on another | |\n", tp, tp, l, o)
	}
}

// wantTrips is the round trips a call of a flow must cost, in order; read
// is true for a call routed to the encoder on a replica that does not hold
// the req_id's pin yet. A first-time /send claims first, then its exchange
// reads the pin.
func wantTrips(what string, read bool) []string {
	var want []string
	switch what {
	case "/encode":
		return []string{"pin place", "pin encoded"}
	case "/send, first time":
		want = append(want, "claim")
	case "/send, replayed", "/send, replayed on the other replica":
		return []string{"claim"}
	}
	if read {
		want = append(want, "hgetall")
	}
	if what == "/send, first time" {
		want = append(want, "complete")
	}
	return want
}
