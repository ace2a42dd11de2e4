package upstream

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/sglang"
)

// What an encoder's answers teach, and that a dial failure forgets it all:
// whatever answers next at that URL is a new process, perhaps another
// generation (a rolling upgrade), and is learned afresh.
func TestLearnedFactsAndForgetting(t *testing.T) {
	e := &Encoder{}
	now := time.Unix(1_700_000_000, 0)
	answer := func(rt *sglang.Route, status int, body string) {
		v := Verdict{Kind: KindAnswered, Status: status}
		e.learn(rt, &v, []byte(body), now)
	}
	if l := e.Learned(); l.ServesMetadata != Unknown || l.Guess != "" || !l.Since.IsZero() {
		t.Fatalf("new encoder: %+v", l)
	}
	answer(sglang.RouteMetadata, 404, `{"detail":"Not Found"}`)
	if l := e.Learned(); l.ServesMetadata != No || l.Guess != "gen0" || !l.Since.Equal(now) {
		t.Fatalf("after starlette's 404: %+v", l)
	}
	e.learn(sglang.RouteMetadata, &Verdict{Kind: KindDialFailed}, nil, now)
	if l := e.Learned(); l.ServesMetadata != Unknown || l.Guess != "" || l.Forgotten != 1 {
		t.Fatalf("after a dial failure: %+v", l)
	}
	answer(sglang.RouteMetadata, 504, `{"status":"error","message":"Encoder DP rank=1 metadata wait timed out after 180.0s"}`)
	if l := e.Learned(); l.DP != Yes || l.Guess != "gen1" {
		t.Fatalf("after a DP timeout: %+v", l)
	}
	answer(sglang.RouteMetadata, 200, `{"req_id":"r","part_idx":0}`)
	if l := e.Learned(); l.ServesMetadata != Yes {
		t.Fatalf("after a 200 pull: %+v", l)
	}
	answer(sglang.RouteEncode, 500, `{"status":"error","message":"Encode failed on the first request"}`)
	if l := e.Learned(); l.DedupesRankEncodes != Yes {
		t.Fatalf("after GEN0's sibling answer: %+v", l)
	}
	e.gen.Store(GenNew.index())
	if e.forwardsFailedRegistration() || e.Learned().Override != "new" {
		t.Fatal("the new override should answer failed registrations at once")
	}
	e.gen.Store(Gen1.index())
	e.learned.failedRegistration.Store(uint32(No))
	if !e.forwardsFailedRegistration() {
		t.Fatal("the gen1 override should forward over what was learned")
	}
}

// GEN1 DP's words for "not ready yet" (§12) are retried under the default
// metadata policy, like "encode metadata not ready", and never count
// against the breaker.
func TestDPNotReadyTextsAreRetriedNotFaults(t *testing.T) {
	pol := DefaultRetry().Metadata
	for _, body := range []string{
		`{"status":"error","message":"encode metadata not ready","req_id":"r"}`,
		`{"status":"error","message":"Encoder DP rank=1 metadata wait timed out after 180.0s","req_id":"r"}`,
	} {
		v := Judge(sglang.RouteMetadata, &pol, nil, Target{Encoder: "e"}, Observation{Status: 504, Body: []byte(body)})
		if !v.Retry || v.Breaker == MarkFault || v.Cause != CauseExpired {
			t.Errorf("%s: retry %v, breaker %s, cause %s", body, v.Retry, v.Breaker, v.Cause)
		}
	}
	v := Judge(sglang.RouteMetadata, &pol, nil, Target{Encoder: "e"}, Observation{Status: 404,
		Body: []byte(`{"status":"error","message":"Unknown req_id: r","req_id":"r"}`)})
	if v.Breaker == MarkFault {
		t.Errorf("404 Unknown req_id: breaker %s", v.Breaker)
	}
}

// A DP encoder answers a pull or registration 404 "Unknown req_id" when the
// part's /encode has not reached it within its mapping wait (§2, §12).
// While the part's pin is pending (its /encode in flight) that is "not
// ready yet" and the pull is retried; with no pin (the pull already waited
// affinity.unknown_wait for one) the 404 passes at once.
func TestUnknownReqIDWhileEncodePendingIsRetried(t *testing.T) {
	var unknowns atomic.Int64
	unknowns.Store(2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		if unknowns.Add(-1) >= 0 {
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, `{"status":"error","message":"Unknown req_id: r_local_part_0","req_id":"r_local_part_0"}`)
			return
		}
		fmt.Fprint(w, `{"req_id":"r_local_part_0","part_idx":0,"embedding_size":8,"embedding_len":1,"embedding_dim":2}`)
	}))
	t.Cleanup(srv.Close)
	aff := DefaultAffinity()
	aff.UnknownWait = 0
	aff.MetadataCache = 0
	p, err := NewPool(testSettings("e", srv.URL), aff, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(),
		Clock: clock.NewFake(time.Unix(1e9, 0)), Rand: func() float64 { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)

	c := pullCall("none_local_part_0", 0)
	if res := p.Exchange(c); res.Attempts != 1 || res.Verdict.Status != 404 {
		t.Fatalf("no pin: %d attempts, status %d; want the 404 at once", res.Attempts, res.Verdict.Status)
	}
	unknowns.Store(2)
	e := p.Encoders()[0]
	if _, ok := p.pins.Place("r_local_part_0", e.Name, e.id); !ok {
		t.Fatal("place")
	}
	c = pullCall("r_local_part_0", 0)
	res := p.Exchange(c)
	if res.Attempts != 3 || res.Verdict.Status != 200 {
		t.Fatalf("pending pin: %d attempts, status %d %s; want two 404s retried, then 200", res.Attempts, res.Verdict.Status, c.Resp.Body())
	}
	if cnt := e.Breaker.Counts(); cnt.TotalFailures != 0 {
		t.Fatalf("breaker counts %+v", cnt)
	}
}
