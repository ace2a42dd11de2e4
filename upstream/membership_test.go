package upstream

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/sglang"
)

// A draining encoder gets no new /encode and no unpinned call, while the
// follow-ups of req_ids pinned to it still reach it; it is drained once no
// live pin needs it.
func TestDrainingEncoderKeepsItsPinsAndGetsNoNewWork(t *testing.T) {
	a, b := liveEncoder(t, "a"), liveEncoder(t, "b")
	set := testSettings("a", a.URL, "b", b.URL)
	p := newTestPool(t, set, prometheus.NewRegistry())
	pinned := ownedBy(t, p, "a", "pinned")
	if res := p.Exchange(newCall(sglang.RouteEncode, pinned)); res.Verdict.Status != 200 || res.Verdict.Encoder != "a" {
		t.Fatalf("/encode before the drain: %d on %q", res.Verdict.Status, res.Verdict.Encoder)
	}

	set.Encoders[0].Draining = true
	if _, _, err := p.Reload(set); err != nil {
		t.Fatal(err)
	}
	e, _ := p.Lookup("a")
	if !e.Draining() {
		t.Fatal("a is not draining after the reload")
	}
	// New work: an /encode that rendezvous would give a goes to b.
	fresh := ownedBy(t, newTestPool(t, testSettings("a", a.URL, "b", b.URL), prometheus.NewRegistry()), "a", "fresh")
	if res := p.Exchange(newCall(sglang.RouteEncode, fresh)); res.Verdict.Status != 200 || res.Verdict.Encoder != "b" {
		t.Fatalf("new /encode while a drains: %d on %q, want 200 on b", res.Verdict.Status, res.Verdict.Encoder)
	}
	if o, err := p.Owner(fresh); err != nil || o.Name != "b" {
		t.Fatalf("Owner of an unpinned req_id while a drains: %v, %v; want b", o, err)
	}
	// A follow-up of the req_id pinned to a still reaches a.
	if res := p.Exchange(newCall(sglang.RouteMetadata, pinned)); res.Verdict.Status != 200 || res.Verdict.Encoder != "a" {
		t.Fatalf("pinned follow-up while a drains: %d on %q, want 200 on a", res.Verdict.Status, res.Verdict.Encoder)
	}
	if d := p.Drained(); len(d) != 0 {
		t.Fatalf("Drained = %v while a pin needs a", d)
	}
	p.pins.Delete(pinned)
	if d := p.Drained(); len(d) != 1 || d[0] != "a" {
		t.Fatalf("Drained = %v once no pin needs a, want [a]", d)
	}
	// Back in its source: it takes new work again.
	set.Encoders[0].Draining = false
	if _, _, err := p.Reload(set); err != nil {
		t.Fatal(err)
	}
	if o, _ := p.Owner(fresh); o.Name != "a" {
		t.Fatalf("Owner after a came back: %s, want a", o.Name)
	}
}

// A failed pin does not hold a draining encoder: its follow-ups are
// answered from the table.
func TestAFailedPinDoesNotHoldADrainingEncoder(t *testing.T) {
	a := liveEncoder(t, "a")
	set := testSettings("a", a.URL)
	set.Encoders[0].Draining = true
	p := newTestPool(t, set, prometheus.NewRegistry())
	e, _ := p.Lookup("a")
	p.pins.Set("r1", "a", e.ID())
	p.pins.Fail("r1", Failure{Status: 500, Message: "x", Answered: true})
	if d := p.Drained(); len(d) != 1 {
		t.Fatalf("Drained = %v with only a failed pin, want [a]", d)
	}
}

// A discovered (joining) encoder starts out of service, is probed at once,
// and joins after health.up_after passed probes; a configured one starts in
// service.
func TestJoiningEncoderStartsDownAndProbesAtOnce(t *testing.T) {
	release := make(chan struct{})
	a := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release // the first probe waits here: the encoder is not up before it passes
		w.WriteHeader(http.StatusOK)
	}))
	defer a.Close()
	defer close(release)
	set := testSettings("a", a.URL)
	set.Health.Disabled = false
	set.Health.UpAfter = 1
	set.Encoders[0].Joining = true
	set.Encoders[0].Source = SourceRegistered
	p := newTestPool(t, set, prometheus.NewRegistry())
	e, _ := p.Lookup("a")
	if e.Source() != SourceRegistered {
		t.Fatalf("Source = %q", e.Source())
	}
	if e.Usable() {
		t.Fatal("a joining encoder is usable before any probe passed")
	}
	if _, err := p.Owner("r"); !errors.Is(err, ErrNoEncoder) {
		t.Fatalf("Owner with only a joining encoder: %v, want ErrNoEncoder", err)
	}
	release <- struct{}{}
	// The fake clock never moves, so only a probe made at once can bring it
	// up; nothing signals the probe's end, so poll for it.
	waitFor(t, func() bool { return e.Usable() })

	h := NewHealth("b", set.Health, func(context.Context) error { return errors.New("down") }, nil, nil, nil, nil)
	h.startDown()
	if h.Up() {
		t.Fatal("a checker that starts down reports up")
	}
	set.Health.Disabled = true
	h = NewHealth("c", set.Health, nil, nil, nil, nil, nil)
	h.startDown()
	if !h.Up() {
		t.Fatal("with checks disabled a joining encoder would never come up")
	}
}

// waitFor polls cond until it holds (10 s at most): for state nothing
// signals, such as a health probe's outcome.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached within 10s")
		}
		time.Sleep(time.Millisecond)
	}
}
