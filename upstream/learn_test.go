package upstream

import (
	"testing"
	"time"

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
