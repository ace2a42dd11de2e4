package gateway

// Gateway replicas on the Redis shapes a production deployment uses, all
// real and on loopback: a Sentinel-managed master whose master dies
// mid-flight, and TLS (with a client certificate too). The cluster shape
// is run by the store tests themselves (idempotency, discovery, upstream:
// TestRedisOnCluster, TestRegistryRedisOnCluster, TestSharedPinsOnCluster).

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/upstream"
)

// mayRetry is the end of the message of a /send the gateway refused
// before forwarding it.
const mayRetry = "; this call forwarded nothing, so the caller may retry it"

// failoverGuard bounds the wait for a /send to succeed after the sentinels
// promoted the replica; it only catches a gateway that never follows the
// new master.
const failoverGuard = 30 * time.Second

// sendReplies sends every rank's /send for id r.dups times at once,
// alternating replicas, and returns the answers.
func (r *redisReplicas) sendReplies(id string) []reply {
	var mu sync.Mutex
	var out []reply
	var wg sync.WaitGroup
	for rank := 0; rank < r.tp; rank++ {
		for d := 0; d < r.dups; d++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if a, ok := r.callAt(r.replica(rank+d), routeSend, id, tpSend(id, rank, r.tp), sendDest(rank)); ok {
					mu.Lock()
					out = append(out, a)
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	return out
}

// prepare makes id's /encode and metadata pull through the first replica,
// so that its /sends find the embedding staged.
func (r *redisReplicas) prepare(id string) bool {
	for _, call := range []struct{ route, body string }{{routeEncode, encodeBody(id)}, {routeMetadata, metaBody(id)}} {
		if a, ok := r.callAt(r.g, call.route, id, call.body, ""); !ok || a.status != http.StatusOK {
			r.t.Errorf("%s %s: %d %s", call.route, id, a.status, a.body)
			return false
		}
	}
	return true
}

// refusedMayRetry reports whether a is a 503 or 504 envelope saying that
// nothing was forwarded and the caller may retry.
func refusedMayRetry(a reply) bool {
	var env struct{ Status, Message string }
	return (a.status == http.StatusServiceUnavailable || a.status == http.StatusGatewayTimeout) &&
		json.Unmarshal([]byte(a.body), &env) == nil && env.Status == "error" && strings.HasSuffix(env.Message, mayRetry)
}

// TestSentinelFailoverMidSends: two replicas share a Sentinel-managed
// Redis (redis-sentinel: master, replica, three sentinels). The master is
// killed (SIGKILL) while parts' /sends, each copy sent three times over
// both replicas, are at the encoders (each answer takes 300ms there), and
// more /sends arrive before the sentinels have promoted the replica. Every
// answer is a 200, or a 503/504 saying nothing was forwarded and the caller
// may retry. After the promotion, with no config change, a new /send gets a
// 200 (the loop only guards against a hang), the answers held while Redis
// was away are stored on the new master, every /send retried on both
// replicas gets a 200, and no (req_id, destination) arrived at the fake
// encoders twice.
//
// What Sentinel guarantees, and so what this shows: replication is
// asynchronous. A write the old master acknowledged but had not yet sent to
// its replica is lost in the failover; a record lost that way lets a later
// duplicate be forwarded again. On loopback the master hands a write to
// its replica in the same event-loop turn as the reply, so a SIGKILL does
// not lose one here; across a network, or with a lagging replica, it can
// (see docs/operations/redis.md).
func TestSentinelFailoverMidSends(t *testing.T) {
	chaosLeakCheck(t)
	s := redistest.StartSentinel(t)
	c := newChaos(t, 2, func(cfg *Config) {
		cfg.Idempotency.Store = "redis"
		cfg.Redis.Mode = redisclient.Sentinel
		cfg.Redis.MasterName = s.MasterName()
		cfg.Redis.SentinelAddrs = s.SentinelAddrs()
		cfg.Redis.Timeout = configfile.Duration(200 * time.Millisecond)
		cfg.Redis.DialTimeout = configfile.Duration(200 * time.Millisecond)
		// The second replica never saw the /encode: while Redis is away it
		// routes follow-ups by rendezvous order at once, to the encoder
		// the first placed the part on.
		cfg.Affinity.UnknownWait = 0
	}, nil)
	r := &redisReplicas{chaos: c, other: serveGateway(t, c.cfg, zap.NewNop(), c.clk)}

	// Before: both replicas dedupe through the master.
	for _, id := range ids("warm", 2) {
		for rank, codes := range r.part(id) {
			for _, code := range codes {
				if code != http.StatusOK {
					t.Fatalf("healthy Redis, %s rank %d: status %d", id, rank, code)
				}
			}
		}
	}
	for _, e := range r.encs {
		f := e.Faults()
		f.Latency = 300 * time.Millisecond
		e.SetFaults(f)
	}
	// Parts whose /sends come while the master is down, staged before.
	late := ids("late", 4)
	var prep sync.WaitGroup
	for _, id := range late {
		prep.Add(1)
		go func() { defer prep.Done(); r.prepare(id) }()
	}
	prep.Wait()
	if t.Failed() {
		t.FailNow()
	}

	var mu sync.Mutex
	var replies []reply
	var wg sync.WaitGroup
	send := func(id string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got := r.sendReplies(id)
			mu.Lock()
			replies = append(replies, got...)
			mu.Unlock()
		}()
	}
	wave := ids("inflight", 8)
	for _, id := range wave {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r.prepare(id) {
				send(id)
			}
		}()
	}
	eventually(t, "a /send of the wave at an encoder", func() bool { return r.arrived(wave) > 0 })
	old := s.KillMaster()
	for _, id := range late {
		send(id)
	}
	wg.Wait()
	now := s.WaitFailover(old)
	t.Logf("master %s killed; the sentinels promoted %s", old, now)

	counts := map[int]int{}
	for _, a := range replies {
		counts[a.status]++
		if a.status != http.StatusOK && !refusedMayRetry(a) {
			t.Errorf("a /send while the master died: %d %s; want 200, or a 503/504 saying the caller may retry", a.status, a.body)
		}
	}
	t.Logf("/sends around the kill: %v", counts)
	if counts[http.StatusServiceUnavailable] == 0 {
		t.Error("no /send was refused: none came while Redis had no master")
	}
	if r.metric("encgate_idempotency_complete_refused_total") < 1 {
		t.Error("no answer was held: no /send was at an encoder when the master died")
	}

	// After the promotion: a new part's /send through either replica gets
	// a 200, the client following the new master with no config change.
	start := time.Now()
	fresh := "fresh-0_local_part_0"
	for i := 0; ; i++ {
		if time.Since(start) > failoverGuard {
			t.Fatalf("no 200 for a new /send within %v of the promotion (%d tries)", failoverGuard, i)
		}
		if a, ok := r.callAt(r.g, routeEncode, fresh, encodeBody(fresh), ""); !ok || a.status != http.StatusOK {
			continue
		}
		a0, ok0 := r.callAt(r.other, routeSend, fresh, tpSend(fresh, 0, r.tp), sendDest(0))
		a1, ok1 := r.callAt(r.g, routeSend, fresh, tpSend(fresh, 1, r.tp), sendDest(1))
		if ok0 && ok1 && a0.status == http.StatusOK && a1.status == http.StatusOK {
			t.Logf("a new /send got its 200 %v after the promotion (%d tries)", time.Since(start).Round(time.Millisecond), i+1)
			break
		}
		for _, a := range []reply{a0, a1} {
			if a.status != http.StatusOK && !refusedMayRetry(a) {
				t.Fatalf("a new /send after the promotion: %d %s", a.status, a.body)
			}
		}
		time.Sleep(50 * time.Millisecond) // polling: the gateway offers no signal for Redis being back
	}

	// The answers held while Redis was away reach the new master; then
	// every /send, retried on both replicas, gets a 200.
	eventually(t, "the held answers to be stored on the new master", func() bool { return r.held() == 0 })
	var retries sync.WaitGroup
	for _, id := range append(append(wave, late...), ids("warm", 2)...) {
		retries.Add(1)
		go func() {
			defer retries.Done()
			// A refusal that says the caller may retry it (the new master
			// slow to answer on a loaded machine: "redis claim: i/o
			// timeout") is retried, as its caller would; any other answer
			// but a 200 fails.
			for start := time.Now(); ; time.Sleep(50 * time.Millisecond) {
				retry := false
				for _, a := range r.sendReplies(id) {
					switch {
					case a.status == http.StatusOK:
					case refusedMayRetry(a) && time.Since(start) < failoverGuard:
						retry = true
					default:
						t.Errorf("after the failover, /send %s: %d %s", id, a.status, a.body)
					}
				}
				if !retry {
					return
				}
			}
		}()
	}
	retries.Wait()
	if lost := r.metric("encgate_idempotency_complete_lost_total"); lost != 0 {
		t.Errorf("encgate_idempotency_complete_lost_total = %v", lost)
	}
	r.check()
}

// tlsGatewayConfig is a gateway config in front of enc whose /send store
// is the TLS-only Redis at addr, reached with tc.
func tlsGatewayConfig(enc *fakeencoder.Encoder, addr string, tc redisclient.TLSConfig) Config {
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: enc.URL()}}
	cfg.Health.Disabled = true
	cfg.Idempotency.Store = "redis"
	cfg.Redis.Addr = addr
	tc.Enabled = true
	cfg.Redis.TLS = tc
	return cfg
}

// TestRedisTLS: a gateway reaches a TLS-only redis-server (its CA made in
// the test) with redis.tls.ca_file, and one that requires a client
// certificate with cert_file and key_file too, and dedupes /sends there. A
// server certificate that does not verify (another CA, or a server_name it
// does not carry), or a server that refuses the gateway's client
// certificate, stops New with an error naming the fields to fix.
func TestRedisTLS(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.EchoSend = true })
	tlsOnly := redistest.Start(t, redistest.WithTLS())
	mutual := redistest.Start(t, redistest.WithMutualTLS())

	for _, tc := range []struct {
		name string
		srv  *redistest.Server
		tls  redisclient.TLSConfig
	}{
		{"ca_file", tlsOnly, redisclient.TLSConfig{CAFile: tlsOnly.TLS().CAFile}},
		{"ca_file, server_name", tlsOnly, redisclient.TLSConfig{CAFile: tlsOnly.TLS().CAFile, ServerName: "localhost"}},
		{"mutual: cert_file, key_file", mutual, redisclient.TLSConfig{CAFile: mutual.TLS().CAFile,
			CertFile: mutual.TLS().ClientCertFile, KeyFile: mutual.TLS().ClientKeyFile}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := serveGateway(t, tlsGatewayConfig(encs[0], tc.srv.Addr(), tc.tls), zap.NewNop(), nil)
			id := "tls-" + strings.NewReplacer(" ", "", ",", "", ":", "").Replace(tc.name) + "_local_part_0"
			if a := post(t, g.base+"/encode", encodeBody(id)); a.status != http.StatusOK {
				t.Fatalf("/encode: %d %s", a.status, a.body)
			}
			first := post(t, g.base+"/send", tpSend(id, 0, 2))
			again := post(t, g.base+"/send", tpSend(id, 0, 2))
			if first.status != http.StatusOK || first.header.Get(headerReplayed) != "" ||
				again.status != http.StatusOK || again.header.Get(headerReplayed) != "true" || again.body != first.body {
				t.Fatalf("/send twice: %d %q %s, then %d %q %s; want a 200, then its replay",
					first.status, first.header.Get(headerReplayed), first.body, again.status, again.header.Get(headerReplayed), again.body)
			}
			if n := encs[0].Stats().SendArrivals[id+"|"+sendDest(0)]; n != 1 {
				t.Fatalf("the /send reached the encoder %d times", n)
			}
			// The record is in the TLS Redis.
			raw := redis.NewClient(&redis.Options{Addr: tc.srv.Addr(), TLSConfig: tc.srv.ClientTLSConfig(), DisableIdentity: true})
			defer raw.Close()
			if n, err := raw.Exists(context.Background(), "encgate:{"+id+"}:rec:"+sendDest(0)).Result(); err != nil || n != 1 {
				t.Fatalf("the record in Redis: %d, %v", n, err)
			}
		})
	}

	otherCert, otherKey := redistest.NewCA(t).IssueClient(t)
	for _, tc := range []struct {
		name string
		srv  *redistest.Server
		tls  redisclient.TLSConfig
		says []string
	}{
		{"another CA", tlsOnly, redisclient.TLSConfig{CAFile: redistest.NewCA(t).CertFile},
			[]string{"redis.tls (ca_file, server_name)", "certificate signed by unknown authority"}},
		{"a server_name the certificate lacks", tlsOnly, redisclient.TLSConfig{CAFile: tlsOnly.TLS().CAFile, ServerName: "redis.example"},
			[]string{"redis.tls (ca_file, server_name)", "not redis.example"}},
		{"no client certificate", mutual, redisclient.TLSConfig{CAFile: mutual.TLS().CAFile},
			[]string{"redis.tls.cert_file, key_file", "certificate required"}},
		{"a client certificate of another CA", mutual, redisclient.TLSConfig{CAFile: mutual.TLS().CAFile, CertFile: otherCert, KeyFile: otherKey},
			[]string{"redis.tls.cert_file, key_file", "unknown certificate authority"}},
	} {
		t.Run("refused: "+tc.name, func(t *testing.T) {
			s, err := New(tlsGatewayConfig(encs[0], tc.srv.Addr(), tc.tls),
				Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), Rand: func() float64 { return 0 }})
			if err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				_ = s.Shutdown(ctx)
				t.Fatal("New started a gateway whose Redis refuses its TLS")
			}
			for _, w := range append(tc.says, "redis at "+tc.srv.Addr()) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("New: %q lacks %q", err, w)
				}
			}
		})
	}
}
